"""Values as JSON, never pickle: the one codec of what shadowgba sends between processes.

    data = encode_value(value, tensors)       # JSON-able; each tensor replaced by its index in `tensors`
    value = decode_value(data, tensors, "trainer 0 (rank 0)")   # `Malformed` naming the source if foreign
    text = to_json(info); info = from_json(text, SessionInfo, "ps/gen1/server0/1/join3")   # store values

Why: a pickle runs whatever code its bytes name, so any process that could reach a server's port or
the job's store could run code in it. JSON carries data only, and this codec turns it into objects
by explicit rules alone. Every message of the PS channel (`shadowgba.ps.wire`) and every structured
store value (`shadowgba.ps.sessions`) goes through it.

The rules (a JSON object always has exactly one key, the rule's tag, so nothing is ambiguous):
- None, bools, ints, floats (NaN and infinities included), strings and lists are JSON's own.
- `{"tuple": [...]}`; `{"dict": [[key, value], ...]}` (any keys this codec encodes, in order);
  `{"tensor": i}`: the i-th tensor sent beside the JSON (CPU, dense; `shadowgba.ps.wire` says how);
  `{"bytes": base64}`; `{"dtype": "float32"}` (torch dtypes, by name); `{"size": [...]}` (torch.Size).
- `{"data": [name, [value, ...]]}`: a dataclass registered here (`LIBRARY_TYPES`, `register`),
  named `module.qualname`, its init fields' values in their order; decoded only if there are
  exactly as many as the class has fields and each value conforms to the field's annotation, then
  built by the class's own `__init__`.
- A field's value is written by its annotation (`_Field`), so that the hot messages carry no tags
  and no names and are read without a lookup: an int, float, bool, str or `Literal` field as
  itself; a tensor field as its index; a registered dataclass field as the list of its own fields
  (no tag: the annotation names the class); `X | None` as None or X's form; `tuple[X, ...]` and
  `tuple[X, Y]` as a list of their items' forms. Any other annotation (`Any`, other unions, dicts,
  enums) takes the tagged form above, and is checked against the annotation once decoded.
- `{"enum": [name, value]}`: a member of a registered enum.
- `{"error": [name, args, attributes]}`: an exception of a class in `builtins` or in shadowgba
  (`Exception` subclasses only, never `SystemExit` and its kind), with its args and its instance
  attributes (notes included), as pickle would carry it. An exception of any other class travels
  as a `RuntimeError` naming that class and its message.
Anything else is refused when it is encoded (`Unencodable`, naming its type); anything a decoder
does not find in these rules is refused (`Malformed`, naming where it came from), and no object
is built from it.
"""

from __future__ import annotations

import base64
import builtins
import dataclasses
import enum
import importlib
import json
import threading
import types
import typing
from collections import abc
from typing import Any, Callable, Iterator, TypeVar

import torch

CODEC_VERSION = 2
"""The version of these rules, written with every store value (`to_json`); the PS channel's frames
carry the wire's own (`shadowgba.ps.wire.WIRE_VERSION`), which covers them. 1: dataclasses' fields
by name, each tagged."""

LIBRARY_TYPES = (
    "shadowgba.ps.wire.Answer",
    "shadowgba.ps.transport.Call", "shadowgba.ps.transport.Caller", "shadowgba.ps.transport.ServiceFailure",
    "shadowgba.ps.sessions.SessionInfo",
    "shadowgba.gba.shards.Decision", "shadowgba.gba.shards.Void", "shadowgba.gba.shards.PushRequest",
    "shadowgba.gba.shards.ShardReply", "shadowgba.gba.config.GBAConfig",
    "shadowgba.gba.switch_policy.SwitchPolicyConfig", "shadowgba.flat_optimizer.OptimizerSpec",
    "shadowgba.flat_optimizer.LRSchedule", "sync_algos.gba.Admission", "sync_algos.staleness.StalenessDecayConfig",
)
"""Every dataclass and enum of the library that crosses a process boundary, by `module.qualname`:
the registry is this list (imported at its first use, from these names alone), plus what
`register` adds (a service's own types)."""

T = TypeVar("T")


class Unencodable(TypeError):
    """A value of a type no rule here encodes (the message names it): nothing of it was sent or stored."""


class Malformed(ValueError):
    """Received or stored data that this codec did not write: refused, and nothing of it was built."""


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class _Registry:
    """The dataclasses and enums that may be decoded, by name, with their fields' annotations."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loaded = False
        self.by_name: dict[str, type] = {}
        self.names: dict[type, str] = {}
        self._schemas: dict[type, _Schema] = {}

    def add(self, cls: type) -> None:
        if not (dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum)):
            raise TypeError(f"only dataclasses and enums can be registered with the codec, not {_name(cls)}")
        with self._lock:
            self.by_name[_name(cls)], self.names[cls] = cls, _name(cls)

    def schema(self, cls: type) -> "_Schema":
        """Dataclass `cls`'s init fields and how each is written and read, made once."""
        schema = self._schemas.get(cls)
        if schema is None:
            self.load()
            hints = typing.get_type_hints(cls)
            fields = tuple(_Field(field.name, *_typed(hints[field.name], self))
                           for field in dataclasses.fields(cls) if field.init)
            schema = self._schemas[cls] = _Schema(cls, fields)
        return schema

    def load(self) -> "_Registry":
        """The registry, `LIBRARY_TYPES` imported at the first call (their modules import this one)."""
        if not self._loaded:
            for path in LIBRARY_TYPES:
                module, _, qualname = path.rpartition(".")
                self.add(getattr(importlib.import_module(module), qualname))
            self._loaded = True
        return self


Encoder = Callable[[Any, "list[torch.Tensor] | None"], Any]
"""How a field's value becomes JSON-able data (tensors appended to the list); `Unencodable` if it
does not conform to the field's annotation."""
Decoder = Callable[[Any, "list[torch.Tensor]"], Any]
"""How a field's data becomes its value; `Malformed` if it is not what the field's encoder writes."""


@dataclasses.dataclass(frozen=True)
class _Field:
    """One init field of a registered dataclass, and how its value is written and read (by its annotation)."""

    name: str
    encode: Encoder
    decode: Decoder


@dataclasses.dataclass(frozen=True)
class _Schema:
    """A registered dataclass's init fields, in order: its values' positional form."""

    cls: type
    fields: tuple[_Field, ...]

    def encode(self, value: Any, tensors: list[torch.Tensor] | None) -> list[Any]:
        encoded, field = [], None
        try:
            for field in self.fields:
                encoded.append(field.encode(getattr(value, field.name), tensors))
        except Unencodable as error:
            raise Unencodable(f"{_name(self.cls)}.{field.name}: {error}") from None
        return encoded

    def decode(self, data: Any, tensors: list[torch.Tensor]) -> Any:
        """`cls(**fields)`, once `data` holds exactly its fields and each conforms to its annotation."""
        if type(data) is not list or len(data) != len(self.fields):
            got = f"{len(data)} values" if type(data) is list else type(data).__name__
            raise Malformed(f"{_name(self.cls)} has the fields {[field.name for field in self.fields]}, got {got}")
        values, field = {}, None
        try:
            for field, item in zip(self.fields, data):
                values[field.name] = field.decode(item, tensors)
        except Malformed as error:
            raise Malformed(f"{_name(self.cls)}.{field.name} {error}") from None
        try:
            return self.cls(**values)
        except (TypeError, ValueError) as error:  # its own checks (`__post_init__`) refused the values
            raise Malformed(f"{_name(self.cls)} refused its fields: {error}") from None


_REGISTRY = _Registry()


def register(*classes: type) -> None:
    """Let these dataclasses or enums travel (a service's own argument and return types)."""
    for cls in classes:
        _REGISTRY.add(cls)


_DTYPES: dict[str, torch.dtype] = {str(value).removeprefix("torch."): value for value in vars(torch).values()
                                   if isinstance(value, torch.dtype)}
"""Every torch dtype by its name (`float32`, `bfloat16`, ...): how dtypes travel."""


def dtype_named(name: Any) -> torch.dtype:
    """The torch dtype called `name`; `Malformed` for any other value."""
    if not isinstance(name, str) or name not in _DTYPES:
        raise Malformed(f"unknown dtype {name!r}")
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _error_classes() -> Iterator[type[Exception]]:
    """The exception classes that travel as themselves: `Exception` subclasses of builtins and shadowgba."""
    pending: list[type[Exception]] = [Exception]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if cls.__module__ == "builtins" or cls.__module__.startswith("shadowgba."):
            yield cls


def _error_class(name: str) -> type[Exception] | None:
    known = _ERRORS.get(name)
    if known is None:  # a shadowgba module imported since the last look
        _ERRORS.update((_name(cls), cls) for cls in _error_classes())
        known = _ERRORS.get(name)
    return known


_ERRORS: dict[str, type[Exception]] = {}


def encode_value(value: Any, tensors: list[torch.Tensor] | None) -> Any:
    """`value` as JSON-able data by the module's rules; each tensor is appended to `tensors` and
    named by its index (None: tensors are refused). `Unencodable` names a type without a rule."""
    kind = type(value)
    if value is None or kind is str or kind is int or kind is bool or kind is float:
        return value
    if kind is list:
        return [encode_value(item, tensors) for item in value]
    if kind is tuple:
        return {"tuple": [encode_value(item, tensors) for item in value]}
    if kind is dict:
        return {"dict": [[encode_value(key, tensors), encode_value(item, tensors)] for key, item in value.items()]}
    if isinstance(value, torch.Tensor):
        if tensors is None:
            raise Unencodable("a tensor cannot be stored here (store values are JSON only)")
        if value.device.type != "cpu" or value.layout != torch.strided:
            raise Unencodable(f"the PS channel carries dense CPU tensors, got one on {value.device} ({value.layout})")
        tensors.append(value.detach().contiguous())
        return {"tensor": len(tensors) - 1}
    if kind is bytes:
        return {"bytes": base64.b64encode(value).decode("ascii")}
    if kind is torch.dtype:
        return {"dtype": dtype_name(value)}
    if kind is torch.Size:
        return {"size": list(value)}
    if isinstance(value, Exception):
        return {"error": _encode_error(value, tensors)}
    registry = _REGISTRY.load()
    name = registry.names.get(kind)
    if name is None:
        raise Unencodable(f"no rule encodes a {_name(kind)}: shadowgba sends and stores plain data, tensors, and "
                          "the dataclasses and enums registered with shadowgba.ps.codec (register())")
    if isinstance(value, enum.Enum):
        return {"enum": [name, encode_value(value.value, tensors)]}
    return {"data": [name, registry.schema(kind).encode(value, tensors)]}


def encode_fields(value: Any, tensors: list[torch.Tensor] | None) -> list[Any]:
    """A registered dataclass's init fields, each written by its annotation (a message's body:
    `shadowgba.ps.wire`)."""
    return _REGISTRY.schema(type(value)).encode(value, tensors)


def _encode_error(error: Exception, tensors: list[torch.Tensor] | None) -> list[Any]:
    """[class name, args, instance attributes]; a class that does not travel as itself, or args that
    do not encode, become a RuntimeError's message naming the class."""
    cls = type(error)
    if _error_class(_name(cls)) is cls:
        try:
            return [_name(cls), encode_value(list(error.args), tensors), encode_value(dict(vars(error)), tensors)]
        except Unencodable:
            pass
    return [_name(RuntimeError), [f"{_name(cls)}: {error}"], {"dict": []}]


def decode_value(data: Any, tensors: list[torch.Tensor], source: str) -> Any:
    """The value `encode_value` made `data` from, its tensors taken from `tensors`; `Malformed`
    naming `source` (e.g. the peer) when `data` is not something this codec writes."""
    return _from(source, lambda: _decode(data, tensors))


def decode_fields(cls: type[T], data: Any, tensors: list[torch.Tensor], source: str) -> T:
    """An instance of the registered dataclass `cls` from `encode_fields` data (a message's body),
    checked as in `{"data": ...}` (module docstring); `Malformed` naming `source`."""
    return _from(source, lambda: _REGISTRY.schema(cls).decode(data, tensors))


def _from(source: str, decode: Callable[[], T]) -> T:
    """`decode()`, its refusals naming `source`."""
    try:
        return decode()
    except Malformed as error:
        raise Malformed(f"refused data from {source}: {error}") from None
    except RecursionError:
        raise Malformed(f"refused data from {source}: nested too deeply") from None


def _decode(data: Any, tensors: list[torch.Tensor]) -> Any:
    kind = type(data)
    if data is None or kind is str or kind is int or kind is bool or kind is float:
        return data
    if kind is list:
        return [_decode(item, tensors) for item in data]
    if kind is dict and len(data) == 1:
        [(tag, body)] = data.items()
        rule = _DECODERS.get(tag)
        if rule is not None:
            return rule(body, tensors)
        raise Malformed(f"unknown value tag {tag!r}")
    raise Malformed(f"a JSON {kind.__name__} that is no value of this codec")


def _list(body: Any, what: str, length: int | None = None) -> list[Any]:
    if type(body) is not list or (length is not None and len(body) != length):
        raise Malformed(f"{what} must be a list" + ("" if length is None else f" of {length}") + f", got {body!r:.80}")
    return body


def _dict(body: Any, tensors: list[torch.Tensor]) -> dict[Any, Any]:
    result = {}
    for pair in _list(body, "a dict's items"):
        key, value = _list(pair, "a dict item", 2)
        key, value = _decode(key, tensors), _decode(value, tensors)
        try:
            result[key] = value
        except TypeError:  # an unhashable key (a list)
            raise Malformed(f"unhashable dict key {key!r:.80}") from None
    return result


def _tensor(body: Any, tensors: list[torch.Tensor]) -> torch.Tensor:
    if type(body) is not int or not 0 <= body < len(tensors):
        raise Malformed(f"tensor index {body!r} outside the message's {len(tensors)} tensors")
    return tensors[body]


def _bytes(body: Any, _: list[torch.Tensor]) -> bytes:
    try:
        return base64.b64decode(body, validate=True)
    except (TypeError, ValueError):
        raise Malformed(f"bytes that are not base64: {body!r:.80}") from None


def _size(body: Any, _: list[torch.Tensor]) -> torch.Size:
    sizes = _list(body, "a torch.Size")
    if not all(type(size) is int and size >= 0 for size in sizes):
        raise Malformed(f"a torch.Size of non-negative ints, got {sizes!r:.80}")
    return torch.Size(sizes)


def _registered(name: Any, kind: str) -> type:
    """The registered class called `name`, if it is of `kind` ("enum" or "dataclass")."""
    cls = _REGISTRY.load().by_name.get(name) if isinstance(name, str) else None
    if cls is None or (kind == "enum") != issubclass(cls, enum.Enum):
        raise Malformed(f"{name!r:.80} is no {kind} registered with the codec")
    return cls


def _enum(body: Any, tensors: list[torch.Tensor]) -> enum.Enum:
    name, value = _list(body, "an enum", 2)
    cls = _registered(name, "enum")
    try:
        return cls(_decode(value, tensors))
    except ValueError:
        raise Malformed(f"{value!r:.80} is no member of {name}") from None


def _data(body: Any, tensors: list[torch.Tensor]) -> Any:
    name, fields = _list(body, "a dataclass", 2)
    return _REGISTRY.schema(_registered(name, "dataclass")).decode(fields, tensors)


def _anything(_: Any) -> bool:
    return True


def _checker(hint: Any) -> Callable[[Any], bool]:
    """Whether a value is of the annotated type `hint`, as a function made once per field (ints
    count as floats; hints without a rule here, e.g. a TypeVar, are left to the receiver)."""
    if hint is Any or hint is object:
        return _anything
    if hint is None or hint is type(None):
        return lambda value: value is None
    if hint is float:
        return lambda value: type(value) is float or type(value) is int
    if hint is int:
        return lambda value: isinstance(value, int) and not isinstance(value, bool)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is None:
        return (lambda value: isinstance(value, hint)) if isinstance(hint, type) else _anything
    if origin is typing.Union or origin is types.UnionType:
        checks = [_checker(arg) for arg in args]
        return lambda value: any(check(value) for check in checks)
    if origin is typing.Literal:
        return lambda value: value in args
    if not isinstance(origin, type):
        return _anything
    if origin is tuple and args and args[-1] is not Ellipsis:
        checks = [_checker(arg) for arg in args]
        return lambda value: isinstance(value, tuple) and len(value) == len(checks) and all(
            check(item) for check, item in zip(checks, value))
    if issubclass(origin, abc.Mapping) and len(args) == 2:
        keys, items = _checker(args[0]), _checker(args[1])
        return lambda value: isinstance(value, origin) and all(keys(key) and items(item) for key, item in value.items())
    if issubclass(origin, abc.Iterable) and args:
        items = _checker(args[0])
        return lambda value: isinstance(value, origin) and all(map(items, value))
    return lambda value: isinstance(value, origin)


_PLAIN = (int, float, bool, str, type(None))


def _hint_name(hint: Any) -> str:
    return getattr(hint, "__name__", str(hint))


def _typed(hint: Any, registry: _Registry) -> tuple[Encoder, Decoder]:
    """How a field annotated `hint` is written and read (module docstring): plain values as
    themselves, tensors by index, registered dataclasses as their fields' list, `X | None`, tuples;
    any other annotation in the tagged form, checked against it once decoded."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _PLAIN or origin is typing.Literal and all(type(arg) in _PLAIN for arg in args):
        return _plain(_checker(hint), _hint_name(hint))
    if hint is torch.Tensor:
        return _tensor_index, _tensor
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _nested(hint, registry)
    if (origin is typing.Union or origin is types.UnionType) and len(args) == 2 and type(None) in args:
        encode, decode = _typed(next(arg for arg in args if arg is not type(None)), registry)
        return (lambda value, tensors: None if value is None else encode(value, tensors),
                lambda data, tensors: None if data is None else decode(data, tensors))
    if origin is tuple and args:
        return _items(hint, [_typed(arg, registry) for arg in args if arg is not Ellipsis], args[-1] is Ellipsis)
    conforms = _checker(hint)

    def decode(data: Any, tensors: list[torch.Tensor]) -> Any:
        value = _decode(data, tensors)
        if not conforms(value):
            raise Malformed(f"must be {_hint_name(hint)}, got {type(value).__name__} {value!r:.80}")
        return value
    return encode_value, decode


def _plain(conforms: Callable[[Any], bool], what: str) -> tuple[Encoder, Decoder]:
    def encode(value: Any, _: list[torch.Tensor] | None) -> Any:
        if conforms(value):
            return value
        raise Unencodable(f"must be {what}, got {type(value).__name__} {value!r:.80}")

    def decode(data: Any, _: list[torch.Tensor]) -> Any:
        if conforms(data):
            return data
        raise Malformed(f"must be {what}, got {type(data).__name__} {data!r:.80}")
    return encode, decode


def _tensor_index(value: Any, tensors: list[torch.Tensor] | None) -> int:
    if not isinstance(value, torch.Tensor):
        raise Unencodable(f"must be a tensor, got {type(value).__name__}")
    return encode_value(value, tensors)["tensor"]


def _nested(cls: type, registry: _Registry) -> tuple[Encoder, Decoder]:
    """A dataclass in a field annotated with it: its fields' list, if it is registered (checked at
    each use, so the form depends on the annotation alone, not on when the class was registered)."""
    def encode(value: Any, tensors: list[torch.Tensor] | None) -> Any:
        if type(value) is not cls or cls not in registry.names:
            raise Unencodable(f"must be {_name(cls)}, registered with shadowgba.ps.codec, got {type(value).__name__}")
        return registry.schema(cls).encode(value, tensors)

    def decode(data: Any, tensors: list[torch.Tensor]) -> Any:
        if cls not in registry.names:
            raise Malformed(f"is a {_name(cls)}, which is no dataclass registered with the codec")
        return registry.schema(cls).decode(data, tensors)
    return encode, decode


def _items(hint: Any, items: list[tuple[Encoder, Decoder]], repeated: bool) -> tuple[Encoder, Decoder]:
    """`tuple[X, ...]` (`repeated`) or `tuple[X, Y]`: a list of the items' forms."""
    def encode(value: Any, tensors: list[torch.Tensor] | None) -> list[Any]:
        if type(value) is not tuple or not repeated and len(value) != len(items):
            raise Unencodable(f"must be {hint}, got {type(value).__name__} {value!r:.80}")
        if repeated:
            return [items[0][0](item, tensors) for item in value]
        return [encode_item(item, tensors) for (encode_item, _), item in zip(items, value)]

    def decode(data: Any, tensors: list[torch.Tensor]) -> tuple[Any, ...]:
        if type(data) is not list or not repeated and len(data) != len(items):
            raise Malformed(f"must be {hint}, got {type(data).__name__} {data!r:.80}")
        if repeated:
            return tuple(items[0][1](item, tensors) for item in data)
        return tuple(decode_item(item, tensors) for (_, decode_item), item in zip(items, data))
    return encode, decode


def _error(body: Any, tensors: list[torch.Tensor]) -> Exception:
    name, args, attributes = _list(body, "an exception", 3)
    cls = _error_class(name) if isinstance(name, str) else None
    if cls is None:
        raise Malformed(f"{name!r:.80} is no exception class of builtins or shadowgba")
    args = tuple(_decode(_list(args, "an exception's args"), tensors))
    attributes = _decode(attributes, tensors)
    if type(attributes) is not dict or not all(type(key) is str and (key == "__notes__" or not key.startswith("__"))
                                               for key in attributes):
        raise Malformed(f"an exception's attributes must map plain names, got {attributes!r:.80}")
    try:
        error = cls(*args)
    except TypeError:  # an __init__ that takes other parameters than its args (ChannelLost): built without it
        error = cls.__new__(cls, *args)
        error.args = args
    vars(error).update(attributes)
    return error


_DECODERS: dict[str, Callable[[Any, list[torch.Tensor]], Any]] = {
    "tuple": lambda body, tensors: tuple(_decode(_list(body, "a tuple"), tensors)),
    "dict": _dict, "tensor": _tensor, "bytes": _bytes, "size": _size,
    "dtype": lambda body, _: dtype_named(body), "enum": _enum, "data": _data, "error": _error,
}


def to_json(value: Any) -> str:
    """`value` (no tensors) as a JSON document stamped with `CODEC_VERSION`: a store value."""
    return json.dumps({"codec": CODEC_VERSION, "value": encode_value(value, None)})


def from_json(text: str | bytes, expected: type[T], source: str) -> T:
    """The `expected` instance `to_json` wrote as `text`; `Malformed` naming `source` (e.g. the
    store key) when `text` is anything else: not JSON, another version, another type."""
    try:
        document = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise Malformed(f"refused {source}: not JSON written by shadowgba ({str(error)[:80]})") from None
    if type(document) is not dict or sorted(document) != ["codec", "value"] or document["codec"] != CODEC_VERSION:
        raise Malformed(f"refused {source}: not a shadowgba codec {CODEC_VERSION} document ({str(document)[:80]})")
    value = decode_value(document["value"], [], source)
    if not isinstance(value, expected):
        raise Malformed(f"refused {source}: a {_name(expected)} was expected, got {type(value).__name__}")
    return value
