"""Typed messages: how a request or reply dataclass maps to a frame's header map.

A message class is a slotted dataclass declared with ``@message(code)``; each field is one
header key (the field's name, or ``wire=`` when the wire spells it differently), read and
checked by a parser chosen from the field's annotation (``int`` is a signed 64-bit integer,
``str``, ``bool``, ``list[str]``, ``list[int]``, ``dict[str, str]``, ``X | None``) or given
with ``parse=``. A field named ``payload`` is the frame's payload, not a header key.

``Message.decode(header, payload)`` builds the message from a decoded header map, turning a
missing or mistyped field into ``INVALID_ARGUMENT`` (the handlers never see a raw map);
``Message.encode()`` gives the header map back. Pure functions of their input: no sockets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from .errors import ErrorCode, OnceqError

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

Parse = Callable[[str, Any], Any]


def invalid(message: str) -> OnceqError:
    return OnceqError(ErrorCode.INVALID_ARGUMENT, message)


def is_int64(value: object) -> bool:
    """An integer (not a bool) that fits the wire's and the store's signed 64 bits."""
    return type(value) is int and INT64_MIN <= value <= INT64_MAX  # type: ignore[operator]


def p_int(name: str, value: Any) -> int:
    if type(value) is not int:  # decoded headers hold plain ints (a bool is not one)
        raise invalid(f"field {name!r} must be an integer")
    if not INT64_MIN <= value <= INT64_MAX:
        raise invalid(f"field {name!r} is out of range (a signed 64-bit integer)")
    return value


def p_str(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise invalid(f"field {name!r} must be a string")
    return value


def p_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise invalid(f"field {name!r} must be a boolean")
    return value


def p_str_list(name: str, value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise invalid(f"{name} must be a list of strings")
    return value


def p_int_list(name: str, value: Any) -> list[int]:
    if not isinstance(value, list) or not all(is_int64(v) for v in value):
        raise invalid(f"{name} must be a list of integers")
    return value


def p_str_map(name: str, value: Any) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise invalid(f"{name} must be a map of strings")
    return value


def p_map(name: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise invalid(f"{name} must be a map")
    return value


def p_list(name: str, value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise invalid(f"{name} must be a list")
    return value


def p_any(name: str, value: Any) -> Any:
    return value


_BY_ANNOTATION: dict[str, Parse] = {
    "int": p_int, "str": p_str, "bool": p_bool, "list[str]": p_str_list,
    "list[int]": p_int_list, "dict[str, str]": p_str_map, "dict[str, Any]": p_map,
    "list[Any]": p_list, "Any": p_any,
}

_REQUIRED = object()


def field(default: Any = dataclasses.MISSING, *, wire: str | None = None,
          parse: Parse | None = None, factory: Callable[[], Any] | None = None) -> Any:
    """A message field: its wire key (default: its name), its parser (default: from its
    annotation), its default (none: the field is required)."""
    meta = {"wire": wire, "parse": parse}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True, slots=True)
class Spec:
    name: str
    wire: str
    parse: Parse
    optional: bool  # ``X | None``: None (or absent) is a value
    default: Any  # _REQUIRED, or the value (a factory is called)
    factory: Callable[[], Any] | None


def _spec(f: dataclasses.Field[Any]) -> Spec:
    ann = str(f.type).replace(" ", "")
    optional = ann.endswith("|None")
    base = ann[: -len("|None")] if optional else ann
    parse = f.metadata.get("parse") or _BY_ANNOTATION.get(base.replace(",", ", "))
    if parse is None:
        raise TypeError(f"field {f.name}: no parser for {f.type!r}; give parse=")
    if f.default is not dataclasses.MISSING:
        default: Any = f.default
    elif f.default_factory is not dataclasses.MISSING:
        default = None
    else:
        default = _REQUIRED
    factory = None if f.default_factory is dataclasses.MISSING else f.default_factory
    return Spec(f.name, f.metadata.get("wire") or f.name, parse, optional, default, factory)


M = TypeVar("M", bound="Message")

# parsers whose check is written inline in a generated decoder (the parser still raises)
_INLINE: dict[Parse, str] = {
    p_int: "type(v) is int and INT64_MIN <= v <= INT64_MAX",
    p_str: "type(v) is str",
    p_bool: "type(v) is bool",
}


class Message:
    """Base of the typed requests, replies and pushes (``@message`` fills these in)."""

    __slots__ = ()
    CODE: ClassVar[int] = 0
    SPECS: ClassVar[tuple[Spec, ...]] = ()
    HAS_PAYLOAD: ClassVar[bool] = False

    # ``@message`` gives each class a decode and an encode of its own, generated from its
    # fields (``_decoder``, ``_encoder``); these generic ones say what they do
    @classmethod
    def decode(cls: type[M], header: dict[str, Any], payload: bytes = b"") -> M:
        """The message of a decoded header map (and the frame's payload)."""
        values: dict[str, Any] = {}
        for s in cls.SPECS:
            v = header.get(s.wire, _REQUIRED)
            if v is _REQUIRED:  # absent: its default (a required field is refused below)
                if s.factory is not None:
                    values[s.name] = s.factory()
                    continue
                if s.default is not _REQUIRED or s.optional:
                    values[s.name] = None if s.default is _REQUIRED else s.default
                    continue
                v = None
            elif v is None and s.optional:  # nil: none
                values[s.name] = None
                continue
            values[s.name] = s.parse(s.wire, v)
        if cls.HAS_PAYLOAD:
            values["payload"] = payload
        return cls(**values)

    def encode(self) -> dict[str, Any]:
        """The header map: every field that is not None."""
        return {s.wire: v for s in self.SPECS if (v := getattr(self, s.name)) is not None}


def _decoder(cls: type, fields: tuple[dataclasses.Field[Any], ...],
             specs: tuple[Spec, ...]) -> Callable[..., Any]:
    """``decode`` of one message class as straight-line code (one pass over its fields,
    the common checks inline): it runs for every request a broker serves."""
    env: dict[str, Any] = {"_R": _REQUIRED, "INT64_MIN": INT64_MIN, "INT64_MAX": INT64_MAX}
    lines = ["def decode(cls, header, payload=b''):", " get = header.get"]
    by_name = {s.name: s for s in specs}
    args = []
    for i, f in enumerate(fields):
        if f.name == "payload":
            args.append("payload")
            continue
        s = by_name[f.name]
        env[f"p{i}"], env[f"w{i}"], env[f"d{i}"], env[f"f{i}"] = (
            s.parse, s.wire, s.default, s.factory)
        lines.append(f" v = get(w{i}, _R)")
        if s.factory is not None:
            absent = f"f{i}()"
        elif s.default is not _REQUIRED:
            absent = f"d{i}"
        elif s.optional:
            absent = "None"
        else:
            absent = f"p{i}(w{i}, None)"  # a required field: the parser refuses None
        lines.append(f" if v is _R: a{i} = {absent}")
        if s.optional:
            lines.append(f" elif v is None: a{i} = None")
        check = _INLINE.get(s.parse)
        if check is not None:
            lines.append(f" elif {check}: a{i} = v")
        lines.append(f" else: a{i} = p{i}(w{i}, v)")
        args.append(f"a{i}")
    lines.append(f" return cls({', '.join(args)})")
    exec("\n".join(lines), env)  # code built from the class's own fields
    fn = env["decode"]
    fn.__qualname__ = f"{cls.__name__}.decode"
    fn.generated = True  # told apart from a decode a class writes itself
    return classmethod(fn)  # type: ignore[return-value]


def _encoder(specs: tuple[Spec, ...]) -> Callable[..., Any]:
    """``encode`` of one message class: the header map of its fields that are not None."""
    env: dict[str, Any] = {}
    lines = ["def encode(self):", " out = {}"]
    for i, s in enumerate(specs):
        env[f"w{i}"] = s.wire
        lines.append(f" v = self.{s.name}")
        lines.append(f" if v is not None: out[w{i}] = v")
    lines.append(" return out")
    exec("\n".join(lines), env)  # code built from the class's own fields
    return env["encode"]  # type: ignore[no-any-return]


def message(code: int = 0) -> Callable[[type[M]], type[M]]:
    """Make ``cls`` a slotted dataclass message with request, push (or, 0, reply) code."""

    def wrap(cls: type[M]) -> type[M]:
        own = set(vars(cls))  # a class may write its own decode or encode
        dc = dataclasses.dataclass(slots=True)(cls)
        fields = dataclasses.fields(dc)
        dc.CODE = code
        dc.HAS_PAYLOAD = any(f.name == "payload" for f in fields)
        dc.SPECS = tuple(_spec(f) for f in fields if f.name != "payload")
        if "decode" not in own:
            dc.decode = _decoder(dc, fields, dc.SPECS)  # type: ignore[method-assign]
        if "encode" not in own:
            dc.encode = _encoder(dc.SPECS)  # type: ignore[method-assign]
        return dc

    return wrap
