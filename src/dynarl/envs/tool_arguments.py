"""A tool's arguments: the pydantic model and JSON Schema derived from a method's type
hints and docstring, and the validation of what the model passes, with every refusal
written for the model.

Also the errors of tools, which both this module and :mod:`dynarl.envs.tools` raise.
"""

import inspect
import typing
from collections.abc import Callable, Mapping
from typing import Any

import docstring_parser
import pydantic
import pydantic.json_schema

from dynarl.core.errors import DynaRLError


class ToolError(DynaRLError):
    """Root of the errors of tools."""


class ToolDefinitionError(ToolError):
    """A tool is declared or wired wrongly (say an un-annotated parameter, or no value
    for a hidden one): a bug of the environment's, the message names the tool and fix."""


class ToolArgumentError(ToolError):
    """The model's arguments do not fit the tool; the message is written for the model
    (which argument, and why)."""


class ToolArguments:
    """The arguments the model gives one tool: their model, schema and validation.

    Built from the method (its first parameter, ``self``, and the ``hidden`` ones are
    left out). Fields are named ``p0, p1, ...`` with the parameter's name as alias, so
    a parameter may be called ``json`` or ``model_x`` without clashing with pydantic.
    """

    def __init__(self, fn: Callable[..., Any], *, tool_name: str, hidden: frozenset[str]) -> None:
        self._tool_name = tool_name
        where = f"tool {tool_name!r} ({fn.__qualname__})"
        try:
            hints = typing.get_type_hints(fn, include_extras=True)
        except Exception as exc:
            raise ToolDefinitionError(
                f"{where}: its type hints cannot be resolved ({exc}); import the types "
                "they name in the tool's module"
            ) from exc
        doc = docstring_parser.parse(inspect.getdoc(fn) or "")
        described = {param.arg_name: param.description for param in doc.params}
        parameters = list(inspect.signature(fn).parameters.values())[1:]
        visible = [param for param in parameters if param.name not in hidden]
        self.aliases: dict[str, str] = {f"p{n}": param.name for n, param in enumerate(visible)}
        """Field name -> parameter name."""
        fields: dict[str, Any] = {
            field: (
                hints[param.name],
                pydantic.Field(
                    ... if param.default is param.empty else param.default,
                    alias=param.name,
                    description=described.get(param.name),
                ),
            )
            for field, param in zip(self.aliases, visible, strict=True)
        }
        config = pydantic.ConfigDict(extra="forbid")
        try:
            self.model: type[pydantic.BaseModel] = pydantic.create_model(
                f"{tool_name}_arguments", __config__=config, **fields
            )
            """The arguments' pydantic model (lax mode, unknown arguments refused)."""
            schema = self.model.model_json_schema(schema_generator=_Untitled)
        except (pydantic.PydanticUserError, TypeError) as exc:
            raise ToolDefinitionError(
                f"{where}: its parameters cannot be validated ({str(exc).splitlines()[0]}); "
                "use types pydantic knows (str, int, float, bool, Literal, lists, dicts, "
                "models), or make the parameter hidden if the environment supplies it"
            ) from exc
        del schema["title"]
        self.schema: dict[str, Any] = schema
        """The JSON Schema of the arguments, without pydantic's made-up titles."""

    def validate(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """``arguments`` as keyword arguments of the method; omitted optional ones are
        left to the method's defaults. Raises :class:`ToolArgumentError` naming each
        bad argument."""
        try:
            values = self.model.model_validate(dict(arguments))
        except pydantic.ValidationError as exc:
            raise ToolArgumentError(self._explain(exc)) from None
        return {self.aliases[field]: getattr(values, field) for field in values.model_fields_set}

    def _explain(self, exc: pydantic.ValidationError) -> str:
        """The model-facing account of a validation failure: one clause per error."""
        problems = []
        unknown_or_missing = False
        for error in exc.errors(include_url=False):
            first, *rest = error["loc"]  # ("tags", 1) -> tags[1]
            where = str(first) + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in rest)
            if error["type"] == "extra_forbidden":
                problems.append(f"unexpected argument {where!r}")
                unknown_or_missing = True
            elif error["type"] == "missing":
                problems.append(f"missing required argument {where!r}")
                unknown_or_missing = True
            else:
                problems.append(f"argument {where!r}: {error['msg']} (got {error['input']!r:.60})")
        name = self._tool_name
        if unknown_or_missing:
            problems.append(f"{name} takes: {', '.join(self.aliases.values()) or 'no arguments'}")
        return f"invalid arguments for {name}: " + "; ".join(problems)


class _Untitled(pydantic.json_schema.GenerateJsonSchema):
    """JSON schemas without the titles pydantic makes up from field names (noise in a
    tool prompt)."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False
