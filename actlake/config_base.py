"""What every job's config shares: pydantic base models, YAML reading with line numbers, one-line errors.

A config is a tree of :class:`Section` models under a :class:`ConfigRoot`. Each field's docstring is its
documentation (pydantic's ``use_attribute_docstrings``); :func:`reference_markdown` turns them into the
the configuration reference (docs/configuration.md). Validation errors become one :class:`ConfigError` line naming the file,
the line and the dotted key, with a did-you-mean for unknown keys.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import types
import typing
from typing import Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    PrivateAttr,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from actlake.errors import ConfigError, StorageError
from actlake.fs import resolve_text, url_scheme

# --------------------------------------------------------------------------- paths


def _location(value: str) -> str:
    """A path a config holds, resolved once at load (:func:`actlake.fs.resolve_text`): an object-store URL
    as it is, anything else an absolute local path (``~`` expanded, relative to the working directory)."""

    try:
        return resolve_text(value, key="")
    except StorageError as e:
        raise ValueError(str(e).removeprefix(": ")) from None


def _local_path(value: str) -> str:
    if url_scheme(value) not in (None, "file"):
        raise ValueError(f"{value!r}: must be a local folder or a shared mount, not an object store")
    return _location(value)


PACKAGE_PREFIX = "package:"


def looks_local(name: str) -> bool:
    """Whether a model or dataset name is a local folder rather than a hub id (``org/name``) or a
    ``package:MODULE/subdir`` reference: it starts with ``.``, ``/`` or ``~``, exists here, or has more
    than one ``/``."""
    return not name.startswith(PACKAGE_PREFIX) and (
        name.startswith((".", "/", "~")) or os.path.exists(name) or name.count("/") > 1)


def _hub_or_local(value: str) -> str:
    return _local_path(value) if looks_local(value) else value


Location = typing.Annotated[str, AfterValidator(_location)]
"""A local path or glob, or an object-store URL; stored resolved (absolute, or the URL as written)."""
LocalPath = typing.Annotated[str, AfterValidator(_local_path)]
"""A local path (a disk or a shared mount); stored absolute."""
HubOrLocal = typing.Annotated[str, AfterValidator(_hub_or_local)]
"""A hub id, a ``package:`` reference (both kept as written) or a local folder (stored absolute)."""


def _is_section(tp) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


class Section(BaseModel):
    """One mapping of a config file. Types are strict (``1`` is no bool, ``"1"`` no number); a number is
    taken where a float is wanted; unknown keys are refused."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid", strict=True)

    @field_validator("*", mode="before")
    @classmethod
    def _yaml_shorthands(cls, value, info):
        """One string where a list is wanted is a list of one; YAML's integer keys (``0:``) are string keys."""
        tp = cls.model_fields[info.field_name].annotation
        for t in (tp, *typing.get_args(tp)):
            origin = typing.get_origin(t)
            if origin is list and isinstance(value, str):
                return [value]
            if origin is dict and typing.get_args(t)[0] is str and isinstance(value, dict):
                return {(str(k) if isinstance(k, int) and not isinstance(k, bool) else k): v for k, v in value.items()}
            if t is dict and isinstance(value, dict) and not all(isinstance(k, str) for k in value):
                raise ValueError("keys must be strings")
        return value

    @classmethod
    def with_defaults(cls, **defaults) -> type:
        """A subclass whose fields named in ``defaults`` default to those values (type and docstring kept)."""
        fields = {name: (cls.model_fields[name].annotation, FieldInfo.merge_field_infos(cls.model_fields[name], default=value))
                  for name, value in defaults.items()}
        return create_model(cls.__name__, __base__=cls, __module__=cls.__module__, **fields)


def config_error(key, message: str):
    """Raise the error of a value check: ``key`` the dotted path as a tuple; :func:`validate` names the line."""
    raise PydanticCustomError("config_value", "{message}", {"key": (key,) if isinstance(key, str) else tuple(key),
                                                            "message": message})


class ConfigRoot(Section):
    """A whole config file: it remembers the file it came from, and ``check(err)`` checks values across
    sections after the types (``err(key_path, message)`` raises). A job sets the default name
    (``with_defaults(name=...)``)."""

    name: str
    """Job name; part of the default run id."""
    _source_file: str | None = PrivateAttr(default=None)

    @property
    def source_file(self) -> str | None:
        return self._source_file

    @source_file.setter
    def source_file(self, value: str | None) -> None:
        self._source_file = value

    @model_validator(mode="before")
    @classmethod
    def _missing_sections_take_their_defaults(cls, data):
        if isinstance(data, dict):
            data = {**{name: {} for name, f in cls.model_fields.items() if f.is_required() and _is_section(f.annotation)},
                    **data}
        return data

    @model_validator(mode="after")
    def _checked(self):
        self.check(config_error)
        return self

    def check(self, err) -> None:
        """Value checks that involve more than one field; none by default."""

    def to_dict(self) -> dict:
        return self.model_dump()


# --------------------------------------------------------------------------- YAML


class _Refused(Exception):
    pass


class _ConfigLoader(yaml.SafeLoader):
    """SafeLoader that refuses the first anchor or alias as it composes: a config has no use for them, and
    aliases let a few hundred bytes expand to billions of nodes (the "billion laughs")."""

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            kind, name = "alias", f"*{event.anchor}"
        elif getattr(event, "anchor", None) is not None:
            kind, name = "anchor", f"&{event.anchor}"
        else:
            return super().compose_node(parent, index)
        raise _Refused(f"line {event.start_mark.line + 1}: YAML {kind} {name} is not allowed in a config "
                       f"(anchors and aliases are refused; write the value out)")


def _compose_with_lines(text: str, where: str):
    """Parse YAML once (refusing anchors and aliases); return (data, {key path: line number})."""
    loader = _ConfigLoader(text)
    try:
        node = loader.get_single_node()
        data = None if node is None else loader.construct_document(node)
    except _Refused as e:
        raise ConfigError(f"{where}, {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML: {e}") from None
    finally:
        loader.dispose()
    lines: dict[tuple, int] = {}

    def walk(n, path):
        if isinstance(n, yaml.MappingNode):
            for k, v in n.value:
                lines[path + (k.value,)] = k.start_mark.line + 1
                walk(v, path + (k.value,))
        elif isinstance(n, yaml.SequenceNode):
            for i, v in enumerate(n.value):
                lines[path + (i,)] = v.start_mark.line + 1
                walk(v, path + (i,))

    if node is not None:
        walk(node, ())
    return ({} if data is None else data), lines


# --------------------------------------------------------------------------- errors


def _line(lines: dict, key: tuple) -> int | None:
    return next((lines[key[:i]] for i in range(len(key), 0, -1) if key[:i] in lines), None)


def _fail(where: str, lines: dict, key, msg: str):
    """Raise the one-line ConfigError: file, line of ``key`` (or of its nearest parent), dotted key, message."""
    key = (key,) if isinstance(key, str) else tuple(key)
    line = _line(lines, key)
    if not msg.startswith("unknown key"):
        msg = f"'{'.'.join(str(p) for p in key)}': {msg}"
    raise ConfigError(f"{where}{f', line {line}' if line else ''}: {msg}")


def _type_name(tp) -> str:
    tp = _bare(tp)
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp)).replace("'", "")
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        kt, vt = typing.get_args(tp)
        return f"mapping of {_type_name(kt)} to {_type_name(vt)}"
    return getattr(tp, "__name__", str(tp))


def _bare(tp):
    """``tp`` without ``Annotated`` metadata (the typed paths are strings)."""
    return typing.get_args(tp)[0] if typing.get_origin(tp) is typing.Annotated else tp


_EXPECTED = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
             dict: "a mapping with string keys"}


_BOUND_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number")
"""pydantic's errors of a bound (``Field(ge=..., lt=...)``) and of ``allow_inf_nan=False``."""


def _bounds(root: type, loc: tuple) -> dict:
    """{'ge': 4, 'lt': 0.5, ...}: the bounds declared on the field (or list item) at ``loc``; {} if none found."""
    tp, meta = root, []
    try:
        for part in loc:
            if _is_section(tp):
                f = tp.model_fields[part]
                tp, meta = f.annotation, list(f.metadata)
            else:  # list item or mapping value: its bounds are in its Annotated metadata
                tp = typing.get_args(_bare(tp))[-1]
                meta = list(typing.get_args(tp)[1:]) if typing.get_origin(tp) is typing.Annotated else []
    except (KeyError, IndexError):
        return {}
    flat = [m2 for m in meta for m2 in (m.metadata if isinstance(m, FieldInfo) else [m])]
    return {k: getattr(m, k) for m in flat for k in ("ge", "gt", "le", "lt") if getattr(m, k, None) is not None}


def _bound_message(bounds: dict, error: dict) -> str:
    """'must be at least 4, got 2', 'must be in (0, 1], got 1.5', 'must be finite and in (0, 1], got nan'."""
    bounds = bounds or dict(error.get("ctx") or {})

    def num(b) -> str:
        return f"{b:g}" if isinstance(b, float) else f"{b:,}"

    lo = next(((k, bounds[k]) for k in ("ge", "gt") if k in bounds), None)
    hi = next(((k, bounds[k]) for k in ("le", "lt") if k in bounds), None)
    if lo and hi:
        rule = f"in {'[' if lo[0] == 'ge' else '('}{num(lo[1])}, {num(hi[1])}{']' if hi[0] == 'le' else ')'}"
    elif lo:
        rule = f"at least {num(lo[1])}" if lo[0] == "ge" else (
            "positive (more than 0)" if lo[1] == 0 else f"more than {num(lo[1])}")
    elif hi:
        rule = f"at most {num(hi[1])}" if hi[0] == "le" else f"less than {num(hi[1])}"
    else:
        rule = "a finite number"
    if error["type"] == "finite_number" and (lo or hi):
        rule = f"finite and {rule}"
    return f"must be {rule}, got {error['input']!r}"


def _problem(root: type, data, error: dict) -> tuple[tuple, str]:
    """(dotted key path, message) of one pydantic error: its ``loc`` walked down the config's types."""
    if error["type"] == "config_value":
        return error["ctx"]["key"], error["ctx"]["message"]
    if error["type"] == "value_error":  # a field validator's message (the typed paths above)
        return tuple(error["loc"]), str(error["ctx"]["error"])
    if error["type"] in _BOUND_ERRORS:
        return tuple(error["loc"]), _bound_message(_bounds(root, tuple(error["loc"])), error)
    tp, path, raw = root, (), data
    for part in error["loc"]:
        if _is_section(tp):
            names = list(tp.model_fields)
            if part not in names:
                dotted = ".".join(str(p) for p in path + (part,))
                close = difflib.get_close_matches(str(part), names, n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else f" (known keys: {', '.join(names)})"
                return path + (part,), f"unknown key '{dotted}'{hint}"
            tp = _bare(tp.model_fields[part].annotation)
        else:
            tp = _bare(typing.get_args(tp)[-1])  # list item or mapping value
        path += (part,)
        try:
            raw = raw[part]
        except (KeyError, IndexError, TypeError):
            raw = error["input"]
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            return path, f"expected {_type_name(tp)}, got {raw!r}"
    value = error["input"]
    if typing.get_origin(tp) is Literal:
        return path, f"expected one of {_type_name(tp)}, got {value!r}"
    if typing.get_origin(tp) in (list, dict):
        return path, f"expected {'a list' if typing.get_origin(tp) is list else 'a mapping'}, got {value!r}"
    if _is_section(tp):
        if isinstance(path[-1], int):
            return path, f"expected a mapping, got {value!r}"
        return path, f"'{'.'.join(str(p) for p in path)}' must be a mapping, got {value!r}"
    hint = ""
    if tp is float and isinstance(value, str):
        try:
            float(value)
            hint = " (YAML reads a number like 1e-9 as text; write 1.0e-9)"
        except ValueError:
            pass
    return path, f"expected {_EXPECTED.get(tp, _type_name(tp))}, got {value!r}{hint}"


def validate(root: type, data, lines: dict | None = None, where: str = "<config>"):
    """A validated config of class ``root`` from a plain mapping; the first problem in the file (by line)
    raises a one-line ConfigError."""
    lines = lines or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: the config must be a YAML mapping, got {type(data).__name__}")
    try:
        cfg = root.model_validate(data)
    except ValidationError as e:
        problems = [_problem(root, data, error) for error in e.errors()]
        key, msg = min(problems, key=lambda p: _line(lines, p[0]) or math.inf)
        _fail(where, lines, key, msg)
    cfg.source_file = where
    return cfg


# --------------------------------------------------------------------------- configuration reference


def reference_markdown(root: type) -> str:
    """A configuration reference table (docs/configuration.md), from the field docstrings."""

    def row(key: str, f: FieldInfo) -> str:
        tp = _type_name(f.annotation).replace("NoneType", "null").replace(" | ", " or ")
        doc = " ".join((f.description or "").split()).replace("``", "`").replace("|", "\\|")  # one table line
        if f.is_required():
            return f"| `{key}` | {tp} | required | {doc} |"
        default = f.get_default(call_default_factory=True)
        return f"| `{key}` | {tp} | `{json.dumps(default, default=lambda m: m.model_dump())}` | {doc} |"

    def rows(prefix: str, cls) -> list[str]:
        lines = []
        for name, f in cls.model_fields.items():
            lines.append(row(f"{prefix}{name}", f))
            inner = typing.get_args(f.annotation)[0] if typing.get_origin(f.annotation) is list else None
            if _is_section(inner):
                lines += rows(f"{prefix}{name}[].", inner)
        return lines

    out = []
    for name, f in root.model_fields.items():
        if name == "name":
            continue
        if _is_section(f.annotation):
            out.append(f"| `{name}` | | | |")
            out += rows(f"{name}.", f.annotation)
        else:
            out.append(row(name, f))
    return "\n".join(["| key | type | default | meaning |", "|---|---|---|---|"] + out)
