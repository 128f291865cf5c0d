"""Loading, overriding and saving configurations.

Files (YAML, TOML, JSON) and dotted overrides (``scheduler.u_low=0.3``) go through one
path: a tree of builtins, converted to :class:`DynaRLConfig` with type validation. Every
failure is a :class:`~dynarl.ConfigError` naming the field, the value and what is
allowed; unknown keys are errors, never ignored, and so is a key a file repeats (YAML
and JSON would keep the last one silently). A tree with several bad fields is reported
in one error that lists each of them.
"""

import json
import re
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import tomli_w
import yaml

from dynarl.api.config import DynaRLConfig
from dynarl.core.errors import ConfigError

T = TypeVar("T", bound=msgspec.Struct)

_PATH = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_UNKNOWN = re.compile(r"Object contains unknown field `(?P<name>[^`]+)`")
_SUFFIXES = {".yaml": "yaml", ".yml": "yaml", ".toml": "toml", ".json": "json"}


def convert(raw: Mapping[str, Any], cls: type[T] = DynaRLConfig) -> T:  # type: ignore[assignment]
    """Validate a tree of builtins into config type ``cls``; every bad field is
    reported, in one :class:`~dynarl.ConfigError`."""
    try:
        return msgspec.convert(raw, cls, strict=False)
    except msgspec.ValidationError as exc:
        first = _error_of(exc, raw, cls)
    errors = _field_errors(raw, cls, raw, [])
    if len(errors) <= 1:
        raise first from None
    lines = "\n".join(f"  - {e}" for e in errors)
    raise ConfigError(f"{len(errors)} config errors:\n{lines}", field=errors[0].field) from None


def _error_of(exc: msgspec.ValidationError, raw: Mapping[str, Any], cls: type) -> ConfigError:
    if isinstance(exc.__cause__, ConfigError):  # a cross-field rule: already explained
        return exc.__cause__
    return _explain(exc, raw, cls)


def _field_errors(
    node: Mapping[str, Any], cls: type, root: Mapping[str, Any], keys: list[str]
) -> list[ConfigError]:
    """Each bad leaf under ``node`` (a section of type ``cls`` at ``keys``), found by
    validating the section with that one field set: msgspec stops at the first error,
    a user fixing a file wants them all. Cross-field rules are left to the whole."""
    fields = _struct_fields(cls)
    if fields is None:
        return []
    errors: list[ConfigError] = []
    for key, value in node.items():
        path = [*keys, key]
        if key not in fields:
            where = ".".join(keys) or "the config root"
            errors.append(
                ConfigError(
                    f"unknown config key {'.'.join(path)!r}: {where} has no field {key!r}; "
                    f"known fields: {', '.join(sorted(fields))}",
                    field=".".join(path),
                )
            )
            continue
        child = _struct_type(fields[key])
        if child is not None and isinstance(value, Mapping):
            errors += _field_errors(value, child, root, path)
            continue
        try:
            msgspec.convert({key: value}, cls, strict=False)
        except msgspec.ValidationError as exc:
            if isinstance(exc.__cause__, ConfigError):
                continue  # a rule between fields: the whole tree's check reports it
            error = _explain(exc, {key: value}, cls)
            field = ".".join(path)
            message = str(error).replace(f"for {key}:", f"for {field}:", 1)
            message = message.replace(f"key {key!r}", f"key {field!r}", 1)
            errors.append(ConfigError(message, field=field))
    return errors


def load_config(path: str | Path, overrides: Iterable[str] = ()) -> DynaRLConfig:
    """Load a YAML, TOML or JSON file, apply dotted ``overrides``, and validate."""
    return apply_overrides(read_config_file(path), overrides)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The tree of builtins a YAML, TOML or JSON config file holds (not validated)."""
    path = Path(path)
    fmt = _SUFFIXES.get(path.suffix.lower())
    if fmt is None:
        raise ConfigError(
            f"cannot load config {str(path)!r}: use a .yaml, .yml, .toml or .json file"
        )
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from None
    try:
        if fmt == "yaml":
            raw = yaml.load(text, Loader=_UniqueKeyLoader) or {}
        elif fmt == "toml":
            raw = tomllib.loads(text)  # refuses a repeated key or table itself
        else:
            raw = json.loads(text, object_pairs_hook=_unique_pairs)
    except _RepeatedKeyError as exc:
        raise ConfigError(
            f"{str(path)!r} repeats {exc}; keep one of them (a repeated section or key "
            "would silently replace the first)",
            field=exc.key,
        ) from None
    except (yaml.YAMLError, tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{str(path)!r} is not valid {fmt}: {exc}") from None
    if not isinstance(raw, dict):
        kind = type(raw).__name__
        raise ConfigError(f"{str(path)!r} must hold a mapping of sections, not a {kind}")
    return raw


class _RepeatedKeyError(ValueError):
    """A mapping in a config file holds the same key twice."""

    def __init__(self, key: str, where: str) -> None:
        super().__init__(f"key {key!r} {where}")
        self.key = key


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a mapping that repeats a key."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _RepeatedKeyError(str(key), f"(lines {seen[key]} and {line})")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _RepeatedKeyError(key, "twice in one object")
        out[key] = value
    return out


@typing.overload
def apply_overrides(
    base: DynaRLConfig | Mapping[str, Any], overrides: Iterable[str]
) -> DynaRLConfig: ...


@typing.overload
def apply_overrides(base: T | Mapping[str, Any], overrides: Iterable[str], cls: type[T]) -> T: ...


def apply_overrides(
    base: msgspec.Struct | Mapping[str, Any],
    overrides: Iterable[str],
    cls: type[msgspec.Struct] = DynaRLConfig,
) -> msgspec.Struct:
    """Apply ``a.b=value`` overrides (values parsed as YAML scalars) and validate into
    ``cls`` (default: the run's :class:`DynaRLConfig`)."""
    raw: dict[str, Any] = (
        msgspec.to_builtins(base) if isinstance(base, msgspec.Struct) else _deepcopy(base)
    )
    for override in overrides:
        key, sep, text = override.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {override!r} must look like section.field=value")
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError:
            value = text
        _set_path(raw, key.split("."), value, cls)
    return convert(raw, cls)


def dump_config(cfg: msgspec.Struct, path: str | Path) -> None:
    """Write a config to ``path`` in the format its suffix names (YAML by default)."""
    path = Path(path)
    data = msgspec.to_builtins(cfg)
    fmt = _SUFFIXES.get(path.suffix.lower(), "yaml")
    if fmt == "toml":
        path.write_text(tomli_w.dumps(_drop_none(data)))
    elif fmt == "json":
        path.write_text(json.dumps(data, indent=2) + "\n")
    else:
        path.write_text(yaml.safe_dump(data, sort_keys=False))


def _drop_none(data: Any) -> Any:
    # TOML has no null: an unset optional field is simply absent.
    if isinstance(data, dict):
        return {k: _drop_none(v) for k, v in data.items() if v is not None}
    return data


def _deepcopy(data: Any) -> Any:
    if isinstance(data, Mapping):
        return {k: _deepcopy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deepcopy(v) for v in data]
    return data


def _set_path(raw: dict[str, Any], keys: list[str], value: Any, cls: type) -> None:
    node = raw
    owner: type | None = cls
    for depth, key in enumerate(keys):
        fields = _struct_fields(owner)
        if fields is not None and key not in fields:
            where = ".".join(keys[:depth]) or "the config root"
            raise ConfigError(
                f"unknown config key {'.'.join(keys)!r}: {where} has no field {key!r}; "
                f"known fields: {', '.join(sorted(fields))}",
                field=".".join(keys),
            )
        owner = _struct_type(fields[key]) if fields is not None else None
        if depth == len(keys) - 1:
            node[key] = value
        else:
            child = node.get(key)
            if not isinstance(child, dict):
                child = {}
                node[key] = child
            node = child


def _struct_fields(cls: type | None) -> dict[str, Any] | None:
    if cls is None or not (isinstance(cls, type) and issubclass(cls, msgspec.Struct)):
        return None
    return {f.name: f.type for f in msgspec.structs.fields(cls)}


def _struct_type(tp: Any) -> type | None:
    """The struct type ``tp`` holds; ``None`` for a union of several structs (a tagged
    union: which member applies depends on the value, so it is checked as a whole)."""
    structs = [t for t in _flatten(tp) if isinstance(t, type) and issubclass(t, msgspec.Struct)]
    return structs[0] if len(structs) == 1 else None


def _flatten(tp: Any) -> list[Any]:
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _flatten(typing.get_args(tp)[0])
    if origin in (typing.Union, types.UnionType):
        return [t for a in typing.get_args(tp) for t in _flatten(a)]
    return [tp]


def _explain(exc: msgspec.ValidationError, raw: Mapping[str, Any], cls: type) -> ConfigError:
    message = str(exc)
    match = _PATH.search(message)
    path = match.group("path") if match else ""
    reason = message[: match.start()] if match else message
    keys = [k for k in re.split(r"\.|\[|\]", path) if k]
    unknown = _UNKNOWN.match(reason)
    if unknown:
        keys.append(unknown.group("name"))
        parent = _type_at(cls, keys[:-1])
        fields = _struct_fields(parent) or {}
        return ConfigError(
            f"unknown config key {'.'.join(keys)!r}; known fields there: "
            f"{', '.join(sorted(fields))}",
            field=".".join(keys),
        )
    field = ".".join(keys)
    value = _value_at(raw, keys)
    allowed = _describe(_field_type(cls, keys))
    got = f" got {value!r}:" if value is not _MISSING else ""
    hint = f" allowed: {allowed}" if allowed else ""
    return ConfigError(
        f"invalid config value for {field or 'the config'}:{got} {reason}.{hint}", field=field
    )


_MISSING = object()


def _value_at(raw: Any, keys: list[str]) -> Any:
    node = raw
    for k in keys:
        if isinstance(node, Mapping) and k in node:
            node = node[k]
        elif isinstance(node, list) and k.isdigit() and int(k) < len(node):
            node = node[int(k)]
        else:
            return _MISSING
    return node


def _type_at(cls: type, keys: list[str]) -> type | None:
    owner: type | None = cls
    for k in keys:
        fields = _struct_fields(owner)
        if fields is None or k not in fields:
            return None
        owner = _struct_type(fields[k])
    return owner


def _field_type(cls: type, keys: list[str]) -> Any:
    if not keys:
        return None
    owner = _type_at(cls, keys[:-1])
    fields = _struct_fields(owner) or {}
    return fields.get(keys[-1])


def _describe(tp: Any) -> str:
    """Say in words what a field accepts."""
    if tp is None:
        return ""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        base, *metas = typing.get_args(tp)
        bounds = []
        for meta in metas:
            if isinstance(meta, msgspec.Meta):
                for name, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
                    bound = getattr(meta, name)
                    if bound is not None:
                        bounds.append(f"{op} {bound}")
        return f"{_describe(base)} {' and '.join(bounds)}".strip()
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return f"a {tp.__name__} section"
    name = getattr(tp, "__name__", str(tp))
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"
