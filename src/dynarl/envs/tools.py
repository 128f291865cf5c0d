"""Tools: plain typed methods of an environment that the model may call.

``@tool`` (or ``@tool(timeout_s=10, hidden=("api_key",))``) above a method, sync or
async, makes it a tool whose JSON schema comes from its type hints and docstring (the
description, and each parameter's from the Args section), so the code is the single
source of what the model is told. The method becomes a :class:`ToolSpec`, which still
reads as the method on an instance and, on the class, describes the tool:
:attr:`ToolSpec.schema` for the chat template, :meth:`ToolSpec.validate` for the
model's arguments (pydantic, lax mode, unknown arguments refused) and
:meth:`ToolSpec.call`, which runs it under its limits and turns whatever goes wrong by
the model's doing into a message for the model.
"""

import contextlib
import functools
import inspect
import json
import logging
import re
import types
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Concatenate, Generic, Literal, ParamSpec, Self, TypeVar, cast, overload

import anyio
import anyio.to_thread
import docstring_parser
import msgspec
import pydantic_core

from dynarl.envs.environment import EnvironmentFailure
from dynarl.envs.tool_arguments import (
    ToolArgumentError,
    ToolArguments,
    ToolDefinitionError,
    ToolError,
)

__all__ = [
    "DEFAULT_MAX_OUTPUT_CHARS",
    "AnyToolSpec",
    "ToolArgumentError",
    "ToolDefinitionError",
    "ToolError",
    "ToolOutput",
    "ToolSpec",
    "ToolStatus",
    "tool",
    "tools_of",
]

logger = logging.getLogger(__name__)

S = TypeVar("S")
P = ParamSpec("P")
R = TypeVar("R")

DEFAULT_MAX_OUTPUT_CHARS = 10_000
"""A tool's output is cut to this many characters unless it says otherwise."""

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


ToolStatus = Literal["ok", "invalid_arguments", "raised", "timed_out"]
"""How a call ended: it returned, its arguments were refused, it raised, or it ran
past its ``timeout_s``."""


class ToolOutput(msgspec.Struct, frozen=True, kw_only=True):
    """What one call gave the model.

    Attributes:
        content: the text the model sees (the output, or ``"Error: ..."``), capped at
            the tool's ``max_output_chars``.
        status: how the call ended.
    """

    content: str
    status: ToolStatus = "ok"

    @property
    def ok(self) -> bool:
        """The tool returned (its output may still describe a failure of its own)."""
        return self.status == "ok"


class ToolSpec(Generic[S, P, R]):
    """One tool: a method, what the model is told about it, and the limits it runs
    under. Made by :func:`tool`; the signature is checked here, the schema is built
    from the type hints on first use (so hints may name classes defined later).

    On an instance it reads as the bound method; on the class, as this spec.
    ``max_concurrency`` is shared by every instance in the process (the spec is a
    class attribute), through one ``anyio.CapacityLimiter`` made on first call: use
    the tool from one event loop.
    """

    def __init__(
        self,
        fn: Callable[Concatenate[S, P], R],
        *,
        name: str | None = None,
        description: str | None = None,
        timeout_s: float | None = None,
        max_output_chars: int | None = DEFAULT_MAX_OUTPUT_CHARS,
        max_concurrency: int | None = None,
        hidden: str | Iterable[str] = (),
    ) -> None:
        if not inspect.isfunction(fn):
            raise ToolDefinitionError(
                f"@tool decorates a function defined with def in the class body, not "
                f"{type(fn).__name__} {fn!r}; put @tool directly above the def"
            )
        self.fn = fn
        self.name = fn.__name__ if name is None else name
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self.max_concurrency = max_concurrency
        self.hidden = frozenset((hidden,) if isinstance(hidden, str) else hidden)
        self._description = description
        self._signature = inspect.signature(fn)
        self._is_async = inspect.iscoroutinefunction(fn)
        self._check_definition()
        self._arguments: ToolArguments | None = None
        self._limiter: anyio.CapacityLimiter | None = None

    @overload
    def __get__(self, obj: None, owner: type[Any] | None = None) -> Self: ...

    @overload
    def __get__(self, obj: S, owner: type[Any] | None = None) -> Callable[P, R]: ...

    def __get__(self, obj: S | None, owner: type[Any] | None = None) -> Self | Callable[P, R]:
        if obj is None:
            return self
        return cast(Callable[P, R], types.MethodType(self.fn, obj))

    def __repr__(self) -> str:
        return f"ToolSpec({self.name!r}, fn={self.fn.__qualname__})"

    @property
    def description(self) -> str:
        """What the model is told the tool does: the override, else the docstring's
        short and long descriptions."""
        if self._description is not None:
            return self._description
        doc = docstring_parser.parse(inspect.getdoc(self.fn) or "")
        parts = (doc.short_description, doc.long_description)
        return "\n\n".join(part for part in parts if part)

    @property
    def parameters(self) -> dict[str, Any]:
        """The JSON Schema of the arguments the model gives (hidden ones left out)."""
        return self._build().schema

    @property
    def schema(self) -> dict[str, Any]:
        """The tool in OpenAI function format, as chat templates take tools."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}

    def validate(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """The model's ``arguments`` as keyword arguments of the method (converted as
        pydantic does in lax mode, e.g. ``"3"`` to ``3`` for an ``int``); omitted
        optional arguments are left to the method's defaults. Raises
        :class:`ToolArgumentError` naming each bad argument; hidden parameters count
        as unknown arguments."""
        return self._build().validate(arguments)

    async def call(
        self, owner: S, arguments: Mapping[str, Any], *, hidden: Mapping[str, Any] | None = None
    ) -> ToolOutput:
        """Run the tool on ``owner`` with the model's ``arguments`` and the hidden
        parameters' values from ``hidden``.

        Invalid arguments, an exception raised by the tool (its type and message, no
        traceback) and a timeout become an ``"Error: ..."`` output for the model.
        :class:`~dynarl.envs.environment.EnvironmentFailure` propagates, and so does a
        :class:`ToolDefinitionError`. A call waits for a ``max_concurrency`` slot
        before its ``timeout_s`` starts. Synchronous tools run in a worker thread; one
        that times out is abandoned there and runs on until it returns.
        """
        try:
            kwargs = self.validate(arguments)
        except ToolArgumentError as exc:
            return ToolOutput(content=self._cap(f"Error: {exc}"), status="invalid_arguments")
        kwargs.update(self._hidden_values(hidden or {}))
        limiter = self._limiter_now()
        returned, value = False, None
        async with limiter if limiter is not None else contextlib.nullcontext():
            try:
                with anyio.move_on_after(self.timeout_s):
                    value = await self._run(owner, kwargs)
                    returned = True
            except Exception as exc:
                if isinstance(exc, EnvironmentFailure) or (
                    isinstance(exc, ExceptionGroup) and exc.subgroup(EnvironmentFailure)
                ):
                    raise
                logger.debug("tool %s raised", self.name, exc_info=True)
                content = f"Error: {type(exc).__name__}: {exc}"
                return ToolOutput(content=self._cap(content), status="raised")
        if not returned:
            content = f"Error: {self.name} timed out after {self.timeout_s:g} s"
            return ToolOutput(content=content, status="timed_out")
        return ToolOutput(content=self._cap(self._text(value)))

    async def _run(self, owner: S, kwargs: dict[str, Any]) -> object:
        fn = cast(Callable[..., Any], self.fn)
        if self._is_async:
            return await cast(Awaitable[object], fn(owner, **kwargs))
        call = functools.partial(fn, owner, **kwargs)
        return await anyio.to_thread.run_sync(call, abandon_on_cancel=True)

    def _limiter_now(self) -> anyio.CapacityLimiter | None:
        """The tool's limiter, made in the running loop on first use."""
        if self.max_concurrency is not None and self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.max_concurrency)
        return self._limiter

    def _hidden_values(self, supplied: Mapping[str, Any]) -> dict[str, Any]:
        values = {}
        for name in sorted(self.hidden):
            if name in supplied:
                values[name] = supplied[name]
            elif self._signature.parameters[name].default is inspect.Parameter.empty:
                raise ToolDefinitionError(
                    f"tool {self.name!r} has no value for its hidden parameter {name!r}; "
                    "supply it per episode (a ToolEnvironment returns it from "
                    "hidden_arguments()) or give the parameter a default"
                )
        return values

    def _text(self, value: object) -> str:
        """The observation of a returned value: a str as is, anything else as JSON."""
        if isinstance(value, str):
            return value
        try:
            return json.dumps(value, ensure_ascii=False, default=pydantic_core.to_jsonable_python)
        except (TypeError, ValueError, pydantic_core.PydanticSerializationError) as exc:
            raise ToolDefinitionError(
                f"tool {self.name!r} returned a value of type {type(value).__name__}, which "
                f"cannot be written as JSON ({exc}); return a str or JSON-serialisable data"
            ) from exc

    def _cap(self, text: str) -> str:
        limit = self.max_output_chars
        if limit is None or len(text) <= limit:
            return text
        return f"{text[:limit]}\n[output truncated: {len(text) - limit} more characters]"

    def _build(self) -> ToolArguments:
        """The arguments' model and schema, built on first use (so hints may name
        classes defined after the tool)."""
        if self._arguments is None:
            self._arguments = ToolArguments(self.fn, tool_name=self.name, hidden=self.hidden)
        return self._arguments

    def _check_definition(self) -> None:
        where = f"tool {self.name!r} ({self.fn.__qualname__})"
        if not _NAME.fullmatch(self.name):
            raise ToolDefinitionError(
                f"{where}: tool names are 1-64 letters, digits, '_' or '-'; pass name=..."
            )
        for option in ("timeout_s", "max_output_chars", "max_concurrency"):
            if (value := getattr(self, option)) is not None and value <= 0:
                raise ToolDefinitionError(f"{where}: {option}={value} must be positive or None")
        params = list(self._signature.parameters.values())
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        if not params or params[0].kind not in positional:
            raise ToolDefinitionError(f"{where}: a tool is a method; its first parameter is self")
        for param in params[1:]:
            if param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
                kind = param.kind
                star = (
                    "*" if kind is kind.VAR_POSITIONAL else "**" if kind is kind.VAR_KEYWORD else ""
                )
                raise ToolDefinitionError(
                    f"{where} takes {star}{param.name} ({kind.description}); tools are "
                    "called by keyword: list each argument as a named, annotated parameter"
                )
            if param.annotation is param.empty and param.name not in self.hidden:
                raise ToolDefinitionError(
                    f"{where}: parameter {param.name!r} has no type annotation; annotate it "
                    f"(e.g. `{param.name}: str`) so its schema and validation can be derived"
                )
        names = {param.name for param in params[1:]}
        if unknown := sorted(self.hidden - names):
            raise ToolDefinitionError(
                f"{where}: hidden={unknown} names no parameter; hidden names are among: "
                f"{', '.join(sorted(names)) or 'none (the tool takes no parameters)'}"
            )


AnyToolSpec = ToolSpec[Any, ..., Any]
"""A tool of any owner and signature."""


@overload
def tool(fn: Callable[Concatenate[S, P], R], /) -> ToolSpec[S, P, R]: ...


@overload
def tool(
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float | None = None,
    max_output_chars: int | None = DEFAULT_MAX_OUTPUT_CHARS,
    max_concurrency: int | None = None,
    hidden: str | Iterable[str] = (),
) -> Callable[[Callable[Concatenate[S, P], R]], ToolSpec[S, P, R]]: ...


def tool(fn: Callable[..., Any] | None = None, /, **options: Any) -> Any:
    """Make a method (sync or async) a tool, as ``@tool`` or ``@tool(...)``.

    Args:
        name: the name the model calls it by (default: the method's).
        description: what the model is told it does (default: the docstring's
            description; each parameter's comes from the docstring's Args section).
        timeout_s: a call running longer is stopped and reported to the model.
        max_output_chars: longer outputs are cut, with a visible marker (``None``:
            never cut).
        max_concurrency: calls running at once across every instance in the
            process (``None``: no limit).
        hidden: parameters the model neither sees nor may set; the environment gives
            their values per episode (a secret, a sandbox handle).
    """

    return functools.partial(ToolSpec, **options) if fn is None else ToolSpec(fn, **options)


def tools_of(obj: object) -> Mapping[str, AnyToolSpec]:
    """The tools of a class or instance, by tool name, base classes' first; a subclass
    attribute of the same name overrides (or, if not a tool, removes) a base's tool.
    Two tools with one name are a :class:`ToolDefinitionError`."""
    cls = obj if isinstance(obj, type) else type(obj)
    by_attribute: dict[str, AnyToolSpec] = {}
    for klass in reversed(cls.__mro__):
        for attribute, value in vars(klass).items():
            if isinstance(value, ToolSpec):
                by_attribute[attribute] = value
            else:
                by_attribute.pop(attribute, None)
    by_name: dict[str, AnyToolSpec] = {}
    for spec in by_attribute.values():
        if (other := by_name.get(spec.name)) is not None:
            raise ToolDefinitionError(
                f"{cls.__qualname__} has two tools named {spec.name!r} "
                f"({other.fn.__qualname__} and {spec.fn.__qualname__}); pass one of them "
                "another name=..."
            )
        by_name[spec.name] = spec
    return types.MappingProxyType(by_name)
