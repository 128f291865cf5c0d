"""Reading the tool calls out of an assistant turn, one parser per model family.

A :class:`ToolCallParser` turns the decoded text of a turn into a :class:`ParsedTurn`:
the prose outside the calls, the well-formed :class:`ToolCall`s, and a
:class:`ParseError` for every malformed one. Nothing the model wrote as a call is
dropped silently: each error carries a ``kind`` (for metrics and tests) and a
``message`` written for the model, which the tool environment shows it so it can
correct itself.

:class:`HermesParser` reads the Hermes format that Qwen and many open models use::

    <tool_call>
    {"name": "calculate", "arguments": {"expression": "347 * 29"}}
    </tool_call>

Families are chosen by name through :data:`PARSERS` and :func:`parser_for`.
"""

import contextlib
import json
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Literal, Protocol

import msgspec

from dynarl.core.errors import DynaRLError

ParseErrorKind = Literal[
    "bad_json",
    "not_object",
    "missing_name",
    "parameters_key",
    "bad_arguments",
    "truncated",
    "unopened",
]
"""What was wrong with a malformed call:

- ``bad_json``: the call's body is not valid JSON, or something follows the object
  before the closing tag;
- ``not_object``: the body is JSON but not an object;
- ``missing_name``: no string ``"name"``;
- ``parameters_key``: the arguments were given as ``"parameters"``;
- ``bad_arguments``: ``"arguments"`` is not an object (nor a string holding one);
- ``truncated``: an opening tag with no closing tag (the turn hit its token limit, or
  the model forgot to close the call);
- ``unopened``: a closing tag with no opening tag.

Calls to tools that do not exist are well-formed here; the tool environment reports
them (it knows the tools).
"""


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """One well-formed call.

    Attributes:
        name: the tool the model called (not necessarily one that exists).
        arguments: its arguments, not yet validated against the tool's schema.
        raw: the call's text, tags included.
    """

    name: str
    arguments: dict[str, Any]
    raw: str


class ParseError(msgspec.Struct, frozen=True, kw_only=True):
    """A malformed call: a record the environment reports, not an exception.

    Attributes:
        kind: what was wrong (see :data:`ParseErrorKind`).
        message: what the model is told, including how to write the call instead.
        raw: the offending text, tags included.
    """

    kind: ParseErrorKind
    message: str
    raw: str


class ParsedTurn(msgspec.Struct, frozen=True, kw_only=True):
    """An assistant turn, read.

    Attributes:
        content: the text outside the calls, stripped (the final answer when there
            are no calls).
        calls: the well-formed calls, in the order written.
        errors: the malformed calls, in the order written.
    """

    content: str
    calls: tuple[ToolCall, ...] = ()
    errors: tuple[ParseError, ...] = ()


class ToolParserError(DynaRLError):
    """No parser is registered under the requested name."""


class ToolCallParser(Protocol):
    """Reads and writes the tool calls of one model family's format."""

    def parse(self, text: str) -> ParsedTurn:
        """The calls, malformed calls and remaining prose of one turn's text."""
        ...

    def render(self, name: str, arguments: Mapping[str, Any]) -> str:
        """The text of one call in this format (what :meth:`parse` reads back), for
        demonstrations."""
        ...


class HermesParser:
    """The Hermes / Qwen format: each call is a JSON object
    ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``;
    a turn may hold several calls and prose around them.

    The JSON is decoded from the opening tag on, and the closing tag is expected right
    after the object, so a ``</tool_call>`` inside a string argument is read as part of
    the string. Lenient where models commonly are and the intent is unambiguous:
    ``"arguments"`` given as a JSON-encoded string holding an object is decoded, a
    missing ``"arguments"`` means no arguments, and other keys (``"id"``, ``"type"``)
    are ignored. Stateless: one instance serves every environment.
    """

    __slots__ = ()

    open_tag = "<tool_call>"
    """Starts a call."""
    close_tag = "</tool_call>"
    """Ends a call."""

    def parse(self, text: str) -> ParsedTurn:
        """The calls, malformed calls and remaining prose of ``text``."""
        decoder = json.JSONDecoder()
        prose: list[str] = []
        calls: list[ToolCall] = []
        errors: list[ParseError] = []

        def add_prose(segment: str) -> None:
            prose.append(segment)
            if self.close_tag in segment:
                errors.append(self._error("unopened", segment.strip()))

        def turn() -> ParsedTurn:
            return ParsedTurn(
                content="".join(prose).strip(), calls=tuple(calls), errors=tuple(errors)
            )

        position = 0
        while (start := text.find(self.open_tag, position)) >= 0:
            add_prose(text[position:start])
            body = _skip_space(text, start + len(self.open_tag))
            try:
                value, end = decoder.raw_decode(text, body)
            except json.JSONDecodeError as exc:
                # Resume at the next call: after this one's closing tag, or at the next
                # opening tag if that comes first (this call was never closed).
                close = text.find(self.close_tag, body)
                reopen = text.find(self.open_tag, body)
                if close < 0 and reopen < 0:
                    errors.append(self._error("truncated", text[start:]))
                    return turn()
                if close < 0 or 0 <= reopen < close:
                    position = reopen
                else:
                    position = close + len(self.close_tag)
                errors.append(self._error("bad_json", text[start:position], exc.msg))
                continue
            after = _skip_space(text, end)
            if text.startswith(self.close_tag, after):
                position = after + len(self.close_tag)
                outcome = self._interpret(value, text[start:position])
                if isinstance(outcome, ToolCall):
                    calls.append(outcome)
                else:
                    errors.append(outcome)
                continue
            close = text.find(self.close_tag, after)
            if close < 0:
                errors.append(self._error("truncated", text[start:]))
                return turn()
            position = close + len(self.close_tag)
            detail = f"unexpected text {text[after:close].strip()[:40]!r} after the object"
            errors.append(self._error("bad_json", text[start:position], detail))
        add_prose(text[position:])
        return turn()

    def render(self, name: str, arguments: Mapping[str, Any]) -> str:
        """``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``."""
        body = json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
        return f"{self.open_tag}\n{body}\n{self.close_tag}"

    def _interpret(self, value: object, raw: str) -> ToolCall | ParseError:
        """A decoded call body as a call, or what is wrong with it."""
        shape = '{"name": <tool name>, "arguments": {...}}'
        if not isinstance(value, dict):
            message = f"the tool call is a JSON {_json_type(value)}; write it as {shape}"
            return ParseError(kind="not_object", message=message, raw=raw)
        name = value.get("name")
        if not isinstance(name, str) or not name:
            message = f'the tool call has no string "name"; write it as {shape}'
            return ParseError(kind="missing_name", message=message, raw=raw)
        if "arguments" not in value and "parameters" in value:
            message = (
                f'the call to {name} gives "parameters"; put the arguments under '
                f'"arguments" instead: {shape}'
            )
            return ParseError(kind="parameters_key", message=message, raw=raw)
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):
            with contextlib.suppress(json.JSONDecodeError):
                arguments = json.loads(arguments) if arguments.strip() else {}
        if not isinstance(arguments, dict):
            message = (
                f'the "arguments" of the call to {name} are a JSON {_json_type(arguments)}; '
                "give an object of argument names to values"
            )
            return ParseError(kind="bad_arguments", message=message, raw=raw)
        return ToolCall(name=name, arguments=arguments, raw=raw)

    def _error(self, kind: ParseErrorKind, raw: str, detail: str = "") -> ParseError:
        """A syntax error of ``kind`` found in ``raw``, with its message to the model."""
        usage = (
            f'write each call as {self.open_tag}{{"name": <tool name>, "arguments": '
            f"{{<argument>: <value>}}}}{self.close_tag}"
        )
        if kind == "truncated":
            message = (
                f"the tool call has no closing {self.close_tag} (it was cut off, or never "
                "closed); keep calls short and close each one"
            )
        elif kind == "unopened":
            message = f"found {self.close_tag} without an opening {self.open_tag}; {usage}"
        else:
            message = f"the tool call is not valid JSON ({detail}); {usage}"
        return ParseError(kind=kind, message=message, raw=raw)


PARSERS: Mapping[str, Callable[[], ToolCallParser]] = MappingProxyType({"hermes": HermesParser})
"""The tool-call formats by name (the model family's ``tool_parser`` name)."""


def parser_for(name: str) -> ToolCallParser:
    """A parser of the format called ``name`` (see :data:`PARSERS`)."""
    try:
        make = PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(PARSERS))
        raise ToolParserError(
            f"no tool-call parser is called {name!r}; use one of: {known}"
        ) from None
    return make()


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position].isspace():
        position += 1
    return position


def _json_type(value: object) -> str:
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return "null" if value is None else "value"
