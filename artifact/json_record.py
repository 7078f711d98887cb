"""Frozen dataclasses read from and written to JSON by their type annotations: one declaration
is the schema, the reader and the writer (the manifest's sections are such records).

A field of type ``str``, ``int``, ``float``, ``bool``, ``tuple[X, ...]`` (a JSON list),
``dict[str, X]`` (an object whose keys are data), another record, ``X | None`` or ``Any`` (a
JSON value kept as it is, for a section another module parses). A field with a default is
absent from the JSON while it holds that default, and takes it when absent; a field without
one must be present (``None`` is then written as ``null``). A key the record does not declare
is refused. Errors are the C++ host's words (``runtime/cpp/src/json.h``): ``<file>:
'<dotted.key>' is missing or not <kind>; recompile``; a record class may set ``MALFORMED`` to
report any error inside it as one line of its own instead (the C++ host's wording for that
section).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from functools import cache
from typing import Any, Iterator

from dsv4c.errors import ArtifactError

_KINDS = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}


class _Mismatch(Exception):
    """A value that is not what its field declares: (dotted key, kind expected)."""


@cache
def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _optional(tp) -> tuple[Any, bool]:
    """(the type without ``None``, whether ``None`` is allowed)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(tp))
    return tp, False


def _kind(tp) -> str:
    tp, _ = _optional(tp)
    origin = typing.get_origin(tp)
    if origin is tuple:
        return "a list"
    if origin is dict or dataclasses.is_dataclass(tp):
        return "an object"
    return _KINDS.get(tp, "a JSON value")


def _parse(tp, value, key: str):
    tp, nullable = _optional(tp)
    if value is None and nullable:
        return None
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _record(tp, value, key)
    if origin is tuple:
        if not isinstance(value, list):
            raise _Mismatch(key, "a list")
        item = typing.get_args(tp)[0]
        if dataclasses.is_dataclass(item):
            return tuple(_parse(item, v, f"{key}[{i}]") for i, v in enumerate(value))
        try:  # a list of plain values is reported whole, as the C++ host reports it
            return tuple(_parse(item, v, key) for v in value)
        except _Mismatch:
            raise _Mismatch(key, "a list") from None
    if origin is dict:
        if not isinstance(value, dict):
            raise _Mismatch(key, "an object")
        item = typing.get_args(tp)[1]
        return {k: _parse(item, v, f"{key}.{k}") for k, v in value.items()}
    ok = {bool: lambda v: type(v) is bool, int: lambda v: type(v) is int, str: lambda v: isinstance(v, str),
          float: lambda v: type(v) in (int, float)}[tp](value)
    if not ok:
        raise _Mismatch(key, _KINDS[tp])
    return float(value) if tp is float else value


def _record(cls, value, key: str):
    prefix = f"{key}." if key else ""
    if not isinstance(value, dict):
        raise _Mismatch(key, "an object")
    hints, fields = _hints(cls), {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in value if k not in fields]
    if unknown:
        raise _Mismatch(prefix + unknown[0], "a key of this format")
    out = {}
    for name, f in fields.items():
        if name in value:
            out[name] = _parse(hints[name], value[name], prefix + name)
        elif not _has_default(f):
            raise _Mismatch(prefix + name, _kind(hints[name]))
    return cls(**out)


def _has_default(f: dataclasses.Field) -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def _default(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def parse_record(cls, value, where: str, key: str = ""):
    """The record ``cls`` from the JSON ``value`` (the section at dotted ``key`` of the file
    ``where``), checked; :class:`ArtifactError` in one line naming the first bad key."""
    try:
        return _record(cls, value, key)
    except _Mismatch as e:
        bad, kind = e.args
        section = next((c for c in _sections(cls, key) if bad == c[0] or bad.startswith(c[0] + ".")
                        or bad.startswith(c[0] + "[")), None)
        if section is not None:
            raise ArtifactError(f"{where}: {section[1]}; recompile") from None
        if kind == "a key of this format":
            raise ArtifactError(f"{where}: '{bad}' is not a key this dsv4c reads; recompile") from None
        raise ArtifactError(f"{where}: '{bad}' is missing or not {kind}; recompile") from None


def _sections(cls, key: str) -> Iterator[tuple[str, str]]:
    """(dotted key, its one-line error) of every field whose record class sets ``MALFORMED``."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        tp, _ = _optional(hints[f.name])
        if typing.get_origin(tp) in (tuple, dict):
            tp = typing.get_args(tp)[-1]
        if dataclasses.is_dataclass(tp):
            name = f"{key}.{f.name}" if key else f.name
            if getattr(tp, "MALFORMED", None):
                yield name, tp.MALFORMED
            else:
                yield from _sections(tp, name)


def to_json(record) -> dict[str, Any]:
    """The JSON object of ``record``: its fields in declaration order, those holding their
    default left out."""
    out = {}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if _has_default(f) and value == _default(f):
            continue
        out[f.name] = _json_value(value)
    return out


def _json_value(value):
    if dataclasses.is_dataclass(value):
        return to_json(value)
    if isinstance(value, tuple):
        return [_json_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_value(v) for k, v in value.items()}
    return value


def keys_of(cls, key: str = "") -> Iterator[str]:
    """The dotted key of every field a record of ``cls`` can hold (``name.<key>`` under a field
    whose keys are data, ``name[]`` inside a list of records; a field typed ``Any`` not
    descended): what a writer of ``cls`` can write."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        name = f"{key}.{f.name}" if key else f.name
        yield name
        tp, _ = _optional(hints[f.name])
        origin = typing.get_origin(tp)
        if origin is dict:
            name, tp = f"{name}.<key>", typing.get_args(tp)[1]
        elif origin is tuple:
            name, tp = f"{name}[]", typing.get_args(tp)[0]
        if dataclasses.is_dataclass(tp):
            yield from keys_of(tp, name)
