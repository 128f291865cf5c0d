"""Tools from typed methods: schemas from hints and docstrings, validated arguments,
limits on time, output and concurrency, and errors that reach the model."""

import threading
import time
from typing import Literal

import anyio
import pytest

from dynarl.envs.environment import EnvironmentFailure
from dynarl.envs.tools import (
    ToolArgumentError,
    ToolDefinitionError,
    ToolOutput,
    ToolSpec,
    tool,
    tools_of,
)


class Library:
    """A fake environment with a few tools."""

    def __init__(self) -> None:
        self.seen: list[object] = []

    @tool(hidden=("token",))
    def search(
        self,
        query: str,
        token: str,
        limit: int = 3,
        kind: Literal["book", "paper"] = "book",
        year: int | None = None,
        tags: list[str] | None = None,
    ) -> list[str]:
        """Search the catalogue.

        Matches titles and authors.

        Args:
            query: words to look for.
            limit: most results to return.
            kind: what to search.
            token: the library card (never shown to the model).
        """
        self.seen.append((query, token, limit, kind, year, tags))
        return [f"{query} #{i}" for i in range(limit)]

    @tool(name="count_words", description="Count the words of a text.", max_output_chars=20)
    async def words(self, text: str) -> str:
        """Ignored: the override wins."""
        return " ".join(["word"] * len(text.split()))


def test_schema_comes_from_the_type_hints_and_the_docstring() -> None:
    assert Library.search.schema == {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the catalogue.\n\nMatches titles and authors.",
            "parameters": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "query": {"type": "string", "description": "words to look for."},
                    "limit": {
                        "type": "integer",
                        "default": 3,
                        "description": "most results to return.",
                    },
                    "kind": {
                        "type": "string",
                        "enum": ["book", "paper"],
                        "default": "book",
                        "description": "what to search.",
                    },
                    "year": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None},
                    "tags": {
                        "anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}],
                        "default": None,
                    },
                },
                "required": ["query"],
            },
        },
    }


def test_name_and_description_can_be_overridden() -> None:
    function = Library.words.schema["function"]
    assert function["name"] == "count_words"
    assert function["description"] == "Count the words of a text."
    assert set(tools_of(Library)) == {"search", "count_words"}


def test_arguments_are_validated_and_converted() -> None:
    assert Library.search.validate({"query": "dune", "limit": "2"}) == {"query": "dune", "limit": 2}
    with pytest.raises(
        ToolArgumentError, match=r"argument 'limit': Input should be a valid integer"
    ):
        Library.search.validate({"query": "dune", "limit": "many"})
    with pytest.raises(ToolArgumentError, match=r"argument 'tags\[1\]'"):
        Library.search.validate({"query": "dune", "tags": ["a", {"b": 1}]})
    with pytest.raises(ToolArgumentError, match=r"argument 'kind'.*'book' or 'paper'"):
        Library.search.validate({"query": "dune", "kind": "film"})
    with pytest.raises(ToolArgumentError, match="missing required argument 'query'"):
        Library.search.validate({})
    with pytest.raises(
        ToolArgumentError, match=r"unexpected argument 'author'.*takes: query, limit"
    ):
        Library.search.validate({"query": "dune", "author": "Herbert"})


def test_the_model_cannot_set_a_hidden_parameter() -> None:
    with pytest.raises(ToolArgumentError, match="unexpected argument 'token'"):
        Library.search.validate({"query": "dune", "token": "stolen"})


async def test_a_call_gets_hidden_values_from_the_environment_and_defaults_from_the_method() -> (
    None
):
    library = Library()
    output = await Library.search.call(library, {"query": "dune"}, hidden={"token": "card-7"})
    assert output == ToolOutput(content='["dune #0", "dune #1", "dune #2"]', status="ok")
    assert output.ok
    assert library.seen == [("dune", "card-7", 3, "book", None, None)]
    with pytest.raises(ToolDefinitionError, match="no value for its hidden parameter 'token'"):
        await Library.search.call(library, {"query": "dune"})


async def test_invalid_arguments_become_an_error_for_the_model() -> None:
    output = await Library.search.call(Library(), {"limit": "x"}, hidden={"token": "t"})
    assert output.status == "invalid_arguments"
    assert output.content.startswith("Error: invalid arguments for search:")
    assert "missing required argument 'query'" in output.content


def test_a_tool_still_reads_as_the_method_on_an_instance() -> None:
    assert Library().search("x", token="t", limit=1) == ["x #0"]
    assert isinstance(Library.__dict__["search"], ToolSpec)


async def test_long_output_is_cut_with_a_visible_marker() -> None:
    output = await Library.words.call(Library(), {"text": "a " * 50})
    assert output.content == "word word word word \n[output truncated: 229 more characters]"


class Flaky:
    @tool
    def divide(self, a: float, b: float) -> float:
        """Divide a by b."""
        return a / b

    @tool
    async def fetch(self, url: str) -> str:
        """Fetch a page."""
        raise EnvironmentFailure("the proxy is down")

    @tool
    async def gather(self, url: str) -> str:
        """Fetch a page in a task group."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.fetch, url)
        return ""

    @tool
    def dump(self) -> object:
        """Return something that is not JSON."""
        return object()


async def test_an_exception_in_a_tool_reaches_the_model_without_a_traceback() -> None:
    output = await Flaky.divide.call(Flaky(), {"a": 1, "b": 0})
    assert output == ToolOutput(
        content="Error: ZeroDivisionError: float division by zero", status="raised"
    )
    assert (await Flaky.divide.call(Flaky(), {"a": 1, "b": 4})).content == "0.25"


async def test_environment_failure_propagates() -> None:
    with pytest.raises(EnvironmentFailure, match="proxy is down"):
        await Flaky.fetch.call(Flaky(), {"url": "x"})
    with pytest.raises(ExceptionGroup) as info:
        await Flaky.gather.call(Flaky(), {"url": "x"})
    assert info.group_contains(EnvironmentFailure)


async def test_output_that_is_not_json_is_the_authors_error() -> None:
    with pytest.raises(ToolDefinitionError, match="'dump' returned a value of type object"):
        await Flaky.dump.call(Flaky(), {})


class Slow:
    def __init__(self) -> None:
        self.release = threading.Event()

    @tool(timeout_s=0.05)
    async def wait(self, seconds: float) -> str:
        """Sleep."""
        await anyio.sleep(seconds)
        return "woke"

    @tool(timeout_s=0.05)
    def block(self) -> str:
        """Block a thread until released."""
        self.release.wait(5)
        return "released"


async def test_a_tool_running_past_its_timeout_is_stopped_and_reported() -> None:
    slow = Slow()
    start = time.perf_counter()
    output = await Slow.wait.call(slow, {"seconds": 10})
    assert output == ToolOutput(content="Error: wait timed out after 0.05 s", status="timed_out")
    assert time.perf_counter() - start < 1.0
    assert (await Slow.wait.call(slow, {"seconds": 0})).content == "woke"


async def test_a_blocking_sync_tool_times_out_without_blocking_the_loop() -> None:
    slow = Slow()
    start = time.perf_counter()
    output = await Slow.block.call(slow, {})
    assert output.status == "timed_out"
    assert time.perf_counter() - start < 1.0
    slow.release.set()  # let the abandoned thread finish before the loop closes
    await anyio.sleep(0.05)


class Sandbox:
    running = 0
    max_running = 0

    @tool(max_concurrency=2)
    async def run(self, code: str) -> str:
        """Run code."""
        Sandbox.running += 1
        Sandbox.max_running = max(Sandbox.max_running, Sandbox.running)
        await anyio.sleep(0.01)
        Sandbox.running -= 1
        return "ok"


async def test_max_concurrency_holds_across_instances() -> None:
    outputs: list[str] = []

    async def one(env: Sandbox) -> None:
        outputs.append((await Sandbox.run.call(env, {"code": "1"})).content)

    async with anyio.create_task_group() as tg:
        for env in [Sandbox() for _ in range(4)] * 3:
            tg.start_soon(one, env)
    assert outputs == ["ok"] * 12
    assert Sandbox.max_running == 2


def test_a_parameter_without_a_type_is_refused_naming_the_tool_and_fix() -> None:
    with pytest.raises(
        ToolDefinitionError, match=r"tool 'f' .*parameter 'x' has no type annotation.*x: str"
    ):

        class Bad:
            @tool
            def f(self, x) -> str:  # type: ignore[no-untyped-def]
                return ""


@pytest.mark.parametrize(
    ("signature", "match"),
    [
        ("*args: int", r"takes \*args"),
        ("**kw: int", r"takes \*\*kw"),
        ("x: int, /", r"takes x \(positional-only\)"),
    ],
)
def test_parameters_not_passable_by_keyword_are_refused(signature: str, match: str) -> None:
    namespace: dict[str, object] = {}
    exec(f"def f(self, {signature}) -> str:\n    return ''", namespace)
    with pytest.raises(ToolDefinitionError, match=match):
        tool(namespace["f"])  # type: ignore[call-overload]


def test_a_hidden_name_that_is_no_parameter_is_refused() -> None:
    with pytest.raises(
        ToolDefinitionError, match=r"hidden=\['secret'\] names no parameter.*among: x"
    ):

        class Bad:
            @tool(hidden="secret")
            def f(self, x: int) -> str:
                return ""


def no_self() -> str:
    return ""


def test_other_bad_definitions_are_refused() -> None:
    with pytest.raises(ToolDefinitionError, match="timeout_s=0 must be positive"):
        tool(timeout_s=0)(Library.search.fn)
    with pytest.raises(ToolDefinitionError, match="tool names are 1-64"):
        tool(name="look up")(Library.search.fn)
    with pytest.raises(ToolDefinitionError, match="decorates a function defined with def"):
        tool(staticmethod(len))
    with pytest.raises(ToolDefinitionError, match="first parameter is self"):
        tool(no_self)  # type: ignore[arg-type]


def test_types_pydantic_cannot_validate_are_refused_on_first_use() -> None:
    class Handle:
        pass

    class Bad:
        @tool
        def f(self, handle: Handle) -> str:
            """Use a handle."""
            return ""

    with pytest.raises(ToolDefinitionError, match=r"tool 'f' .*cannot be validated.*hidden"):
        Bad.f.schema  # noqa: B018


def test_hints_may_name_classes_defined_after_the_tool() -> None:
    class Late:
        @tool
        def f(self, point: "Point") -> str:
            """Take a point."""
            return ""

    assert Late.f.validate({"point": {"x": 1}}) == {"point": Point(x=1)}
    assert Late.f.parameters["properties"]["point"] == {"$ref": "#/$defs/Point"}


def test_tools_of_collects_subclass_overrides_and_refuses_duplicate_names() -> None:
    class Base:
        @tool
        def a(self) -> str:
            """A."""
            return "base"

        @tool
        def b(self) -> str:
            """B."""
            return "b"

    class Child(Base):
        b = None  # type: ignore[assignment]

        @tool
        def a(self) -> str:
            """A, again."""
            return "child"

    assert list(tools_of(Child())) == ["a"]
    assert tools_of(Child)["a"].description == "A, again."

    class Clash(Base):
        @tool(name="a")
        def other(self) -> str:
            """Another a."""
            return ""

    with pytest.raises(ToolDefinitionError, match=r"two tools named 'a'.*another name"):
        tools_of(Clash)


import pydantic  # noqa: E402


class Point(pydantic.BaseModel):
    """A point defined after the tool that takes it."""

    x: int
