"""Reading tool calls out of assistant turns: every call is either parsed or reported."""

import json

import pytest

from dynarl.envs.tool_parser import (
    PARSERS,
    HermesParser,
    ParsedTurn,
    ToolCall,
    ToolParserError,
    parser_for,
)

PARSER = HermesParser()


def call(name: str, arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_one_call_with_text_around_it() -> None:
    text = "Let me compute.\n" + call("calculate", {"expression": "2 + 3"}) + "\nthen answer"
    turn = PARSER.parse(text)
    assert turn.errors == ()
    assert [(c.name, c.arguments) for c in turn.calls] == [("calculate", {"expression": "2 + 3"})]
    assert turn.calls[0].raw == call("calculate", {"expression": "2 + 3"})
    assert turn.content == "Let me compute.\n\nthen answer"


def test_several_calls_in_one_turn_keep_their_order() -> None:
    text = call("a", {"x": 1}) + " and " + call("b", {}) + call("c", {"y": [1, 2]})
    turn = PARSER.parse(text)
    assert [(c.name, c.arguments) for c in turn.calls] == [
        ("a", {"x": 1}),
        ("b", {}),
        ("c", {"y": [1, 2]}),
    ]
    assert turn.content == "and"
    assert turn.errors == ()


def test_text_without_calls_is_all_content() -> None:
    assert PARSER.parse("  The answer is 42.\n") == ParsedTurn(content="The answer is 42.")


def test_closing_tag_inside_a_string_argument_does_not_end_the_call() -> None:
    code = 'print("</tool_call>")'
    turn = PARSER.parse(call("run", {"code": code}) + " done")
    assert turn.errors == ()
    assert turn.calls[0].arguments == {"code": code}
    assert turn.content == "done"


def test_bad_json_is_reported_and_the_next_call_still_parses() -> None:
    bad = '<tool_call>\n{"name": "a", "arguments": {"x": 1,}}\n</tool_call>'
    turn = PARSER.parse("hi " + bad + call("b", {"y": 2}))
    assert [c.name for c in turn.calls] == ["b"]
    (error,) = turn.errors
    assert error.kind == "bad_json"
    assert error.raw == bad
    assert "not valid JSON" in error.message and '"arguments"' in error.message
    assert turn.content == "hi"


def test_an_unclosed_call_before_another_call_does_not_swallow_it() -> None:
    turn = PARSER.parse('<tool_call>{"name": "a", "argu ' + call("b", {}))
    assert [c.name for c in turn.calls] == ["b"]
    assert [e.kind for e in turn.errors] == ["bad_json"]


def test_text_between_the_object_and_the_closing_tag_is_an_error() -> None:
    turn = PARSER.parse('<tool_call>{"name": "a", "arguments": {}}}</tool_call>')
    assert turn.calls == ()
    assert [e.kind for e in turn.errors] == ["bad_json"]
    assert "'}'" in turn.errors[0].message


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "calculate", "arguments": {"expression": "12 *',  # mid-JSON
        '<tool_call>\n{"name": "calculate", "arguments": {"expression": "1"}}\n',  # no tag
        "<tool_call>",
    ],
)
def test_a_call_cut_off_before_its_closing_tag_is_truncated(text: str) -> None:
    turn = PARSER.parse("Thinking. " + text)
    assert turn.calls == ()
    (error,) = turn.errors
    assert error.kind == "truncated"
    assert error.raw == text
    assert "</tool_call>" in error.message
    assert turn.content == "Thinking."


def test_parameters_instead_of_arguments_is_named_in_the_message() -> None:
    text = '<tool_call>{"name": "calculate", "parameters": {"expression": "1"}}</tool_call>'
    (error,) = PARSER.parse(text).errors
    assert error.kind == "parameters_key"
    assert '"parameters"' in error.message and '"arguments"' in error.message


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        ('["calculate", {"expression": "1"}]', "not_object"),
        ('"calculate"', "not_object"),
        ('{"arguments": {"expression": "1"}}', "missing_name"),
        ('{"name": 3, "arguments": {}}', "missing_name"),
        ('{"name": "calculate", "arguments": [1, 2]}', "bad_arguments"),
        ('{"name": "calculate", "arguments": "1 + 2"}', "bad_arguments"),
    ],
)
def test_malformed_call_bodies_are_reported_by_kind(body: str, kind: str) -> None:
    turn = PARSER.parse(f"<tool_call>{body}</tool_call>")
    assert turn.calls == ()
    assert [e.kind for e in turn.errors] == [kind]
    assert turn.errors[0].raw == f"<tool_call>{body}</tool_call>"


def test_arguments_given_as_a_json_string_are_decoded() -> None:
    arguments = json.dumps({"expression": "2 ** 8"})
    (parsed,) = PARSER.parse(call("calculate", arguments)).calls
    assert parsed.arguments == {"expression": "2 ** 8"}


def test_missing_arguments_mean_none_and_extra_keys_are_ignored() -> None:
    text = '<tool_call>{"name": "now", "id": "call_1"}</tool_call>'
    assert PARSER.parse(text).calls == (ToolCall(name="now", arguments={}, raw=text),)


def test_a_closing_tag_without_an_opening_one_is_reported() -> None:
    turn = PARSER.parse('{"name": "a", "arguments": {}}</tool_call>')
    assert turn.calls == ()
    assert [e.kind for e in turn.errors] == ["unopened"]


def test_render_is_read_back_by_parse() -> None:
    arguments = {"expression": "347 * 29", "note": "ünïcode </tool_call>"}
    text = PARSER.render("calculate", arguments)
    assert text.startswith("<tool_call>\n{") and text.endswith("}\n</tool_call>")
    assert PARSER.parse(text).calls == (ToolCall(name="calculate", arguments=arguments, raw=text),)


def test_parsers_are_chosen_by_name() -> None:
    assert isinstance(parser_for("hermes"), HermesParser)
    assert set(PARSERS) == {"hermes"}
    with pytest.raises(ToolParserError, match="use one of: hermes"):
        parser_for("mistral")
