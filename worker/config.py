"""Configuration as frozen msgspec Structs, and the one function that loads them from plain data.

Each area declares its configuration once, as `ConfigStruct` subclasses: a field per setting with
its default (every key is optional unless it has none), its constraints as `msgspec.Meta` in the
type (`PositiveInt`, `Annotated[float, Meta(ge=0, le=1)]`), and a docstring under it saying what it
is and its unit. Rules across fields live in `__post_init__`, which runs both when code constructs
a config and when `load_config` builds one.

    config = load_config(RouterConfig, yaml.safe_load(text)["router"], "router")

`load_config` is `msgspec.convert` plus the repository's conventions:

- Errors are the area's own: msgspec's ValidationError becomes a `ConfigProblem` (what is wrong,
  at which dotted path: `router.placement.prefill_polciy`, `instances[1].num_cpus`) and the
  struct's `config_error` turns that into its area's error type and message shape. An error raised
  by a `__post_init__` rule is re-rooted at the path of the section it was raised in.
- Unknown keys are errors (`forbid_unknown_fields`), named by their full path.
- YAML writes an empty value (`frontend:`) as null: null for a field that cannot be null means its
  default.
- A `DistinctSet` field is written as a list whose entries must not repeat.

Constructing a config directly validates it too (`ConfigStruct.__post_init__`): each field is
checked against its declared type and constraints (an int is a fine float and is stored as one; a
list is a fine tuple); a field typed as a struct takes an instance, not a mapping; an enum field
takes a member, not its name; every float is finite.

Loading files is the caller's business (cluster/deploy/config.py reads YAML); nothing here does I/O.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import re
import typing
from collections.abc import Callable, Mapping
from typing import Annotated, Any, TypeVar

import msgspec
import msgspec.inspect as mi

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]


class ProblemKind(enum.Enum):
    UNKNOWN_KEY = "unknown key"
    MISSING = "missing"
    INVALID = "invalid"
    # A __post_init__ rule (or a field converter) raised `cause`.
    RULE = "rule"


@dataclasses.dataclass(frozen=True)
class ConfigProblem:
    """What is wrong with a configuration, before an area words it as its own error."""

    kind: ProblemKind
    # Dotted path of the offending key or field from the root of what was loaded
    # ("router.health.dead_after_s"); for RULE, of the section whose rule failed.
    path: str
    # What is wrong, in words ("expected `int` >= 1, got 0"); for RULE, str(cause).
    detail: str
    # UNKNOWN_KEY and MISSING: the key, and the struct it belongs to (for "known keys" lists).
    key: str = ""
    owner: type | None = None
    # RULE: the exception raised; its own field path, if it has one, is relative to `path`.
    cause: BaseException | None = None

    @property
    def parent(self) -> str:
        """The path of the section the key belongs to (UNKNOWN_KEY, MISSING)."""
        if self.key and self.path.endswith(self.key):
            return self.path[: -len(self.key)].rstrip(".")
        return self.path


def join_path(prefix: str, path: str) -> str:
    """`prefix` + `path` as one dotted path ("instances[0]" + "engine" -> "instances[0].engine")."""
    if not prefix:
        return path
    if not path:
        return prefix
    return prefix + path if path.startswith("[") else f"{prefix}.{path}"


class DistinctSet(frozenset):  # type: ignore[type-arg]
    """A frozenset field that configuration writes as a list; an entry given twice is an error
    (`allowed_fallbacks: [a, a]` is a typo, not a set of one)."""


class ConfigStruct(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Base of every configuration section. Subclasses that add rules call super().__post_init__()."""

    @classmethod
    def config_error(cls, problem: ConfigProblem) -> Exception:
        """The area's error for `problem`; areas override this to keep their error types."""
        return ValueError(f"{problem.path or '<root>'}: {problem.detail}")

    def __post_init__(self) -> None:
        check_fields(self)


S = TypeVar("S", bound=ConfigStruct)
ErrorFactory = Callable[[ConfigProblem], Exception]


def load_config(cls: type[S], data: object, path: str = "", *, errors: ErrorFactory | None = None) -> S:
    """Build `cls` from plain data (str keys, enums by value or name, lists for tuples and sets).

    `path` is where `data` sits in a larger document (error paths start with it); `errors` words
    problems in another area's error type (the cluster config validates worker sections with it);
    by default `cls.config_error` does.
    """
    make_error = errors or cls.config_error
    if data is None:
        data = {}
    if isinstance(data, Mapping) and not isinstance(data, dict):
        data = dict(data)
    data = _null_is_default(_type_info(cls), data)
    try:
        return msgspec.convert(data, cls, dec_hook=_dec_hook)
    except msgspec.ValidationError as error:
        raise make_error(_problem(error, cls, data, path)) from None


def check_fields(config: ConfigStruct) -> None:
    """Validate a constructed config's fields against their declared types and constraints."""
    cls = type(config)
    for name, hint, takes_struct in _field_specs(cls):
        value = getattr(config, name)
        if takes_struct and isinstance(value, Mapping):
            raise cls.config_error(
                ConfigProblem(ProblemKind.INVALID, name, f"expected a {_type_name(hint)}, got a mapping")
            )
        try:
            converted = msgspec.convert(value, hint, dec_hook=_dec_hook)
        except msgspec.ValidationError as error:
            raise cls.config_error(_problem(error, cls, value, name, field=True)) from None
        if not _same_value(converted, value):
            raise cls.config_error(
                ConfigProblem(ProblemKind.INVALID, name, f"expected a {_type_name(hint)}, got {value!r}")
            )
        if isinstance(converted, float) and not math.isfinite(converted):
            raise cls.config_error(ConfigProblem(ProblemKind.INVALID, name, f"must be a finite number, got {value!r}"))
        if type(converted) is not type(value):
            msgspec.structs.force_setattr(config, name, converted)


def dataclass_compatible(cls: type[S]) -> type[S]:
    """Give a config struct the dataclass protocol (`dataclasses.replace`, `dataclasses.fields`) for
    code written when configs were dataclasses: cluster/cli/main.py and cluster/cli/bench.py replace
    ClusterConfig sections, worker/instance.py lists EngineConfig's fields. New code uses
    `msgspec.structs.replace`; `replace` still runs the struct's validation."""
    shadow = dataclasses.make_dataclass(cls.__name__, [(name, Any) for name in cls.__struct_fields__])
    cls.__dataclass_fields__ = shadow.__dataclass_fields__  # type: ignore[attr-defined]
    cls.__dataclass_params__ = shadow.__dataclass_params__  # type: ignore[attr-defined]
    return cls


# --- internals -------------------------------------------------------------------------------------


_type_info = functools.cache(mi.type_info)


@functools.cache
def _field_specs(cls: type) -> tuple[tuple[str, Any, bool], ...]:
    """(name, declared type, whether the type is or includes a struct) per field of `cls`."""
    specs = []
    for info in msgspec.structs.fields(cls):
        node = _type_info(info.type)
        options = node.types if isinstance(node, mi.UnionType) else (node,)
        specs.append((info.name, info.type, any(isinstance(t, mi.StructType) for t in options)))
    return tuple(specs)


def _type_name(hint: Any) -> str:
    hint = typing.get_args(hint)[0] if typing.get_origin(hint) is Annotated else hint
    return getattr(hint, "__name__", None) or str(hint)


def _same_value(converted: object, value: object) -> bool:
    """Whether conversion only normalised `value` (60 -> 60.0, a list -> a tuple) rather than
    reinterpreting it (a name -> an enum member, a mapping -> a struct)."""
    if converted is value:
        return True
    if isinstance(converted, tuple) and isinstance(value, list):
        return converted == tuple(value)
    if isinstance(converted, frozenset) and isinstance(value, (list, tuple, set, frozenset)):
        return len(converted) == len(value) and converted == frozenset(value)
    return bool(converted == value)


def _dec_hook(hint: Any, value: object) -> object:
    if typing.get_origin(hint) is DistinctSet or hint is DistinctSet:
        (item,) = typing.get_args(hint) or (Any,)
        if not isinstance(value, (list, tuple, set, frozenset)):
            raise TypeError(f"expected `array`, got `{type(value).__name__}`")
        try:
            items = msgspec.convert(list(value), list[item], dec_hook=_dec_hook)
        except msgspec.ValidationError as error:
            what = re.sub(r" - at `\$\[(\d+)\]`$", r" (entry \1)", str(error))
            raise ValueError(what[:1].lower() + what[1:]) from None
        if len(set(items)) != len(items):
            raise ValueError(f"{list(value)!r} contains duplicates")
        return DistinctSet(items)
    raise NotImplementedError(f"no conversion to {hint!r}")


_SEGMENT = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")


def _segments(where: str) -> list[str | int]:
    """msgspec's "$.a.b[0][...]" as ["a", "b", 0, "[...]"]."""
    segments: list[str | int] = []
    for name, index in _SEGMENT.findall(where.removeprefix("$")):
        segments.append(name if name else (int(index) if index.isdigit() else "[...]"))
    return segments


def _dotted(segments: list[str | int]) -> str:
    path = ""
    for segment in segments:
        if isinstance(segment, int):
            path += f"[{segment}]"
        elif segment == "[...]":
            path += segment
        else:
            path = join_path(path, segment)
    return path


_MISSING = object()


def _value_at(data: object, segments: list[str | int]) -> object:
    for segment in segments:
        if isinstance(segment, int) and isinstance(data, (list, tuple)) and segment < len(data):
            data = data[segment]
        elif isinstance(segment, str) and isinstance(data, Mapping) and segment in data:
            data = data[segment]
        else:
            return _MISSING
    return data


def _problem(error: msgspec.ValidationError, cls: type, data: object, path: str, *, field: bool = False) -> ConfigProblem:
    """Read msgspec's error ("<what> - at `$.a.b[0]`") as a ConfigProblem rooted at `path`.

    `field`: `data` is the value of the field `path` of `cls` (check_fields), not a whole `cls`.
    """
    message = str(error)
    cause = error.__cause__
    if cause is not None:
        what, where = str(cause), message[len(str(cause)) :].removeprefix(" - at `").removesuffix("`")
    else:
        what, _, where = message.partition(" - at `")
        where = where.removesuffix("`")
    key_error = where.startswith("key` in `")
    where = where.removeprefix("key` in `") or "$"
    segments = _segments(where)
    full = join_path(path, _dotted(segments))
    if cause is not None:
        return ConfigProblem(ProblemKind.RULE, full, what, cause=cause)
    match = re.fullmatch(r"Object (contains unknown|missing required) field `(.*)`", what)
    if match and not field:
        kind = ProblemKind.UNKNOWN_KEY if match.group(1) == "contains unknown" else ProblemKind.MISSING
        detail = "unknown key" if kind is ProblemKind.UNKNOWN_KEY else "is required"
        key = match.group(2)
        owner = _type_at(cls, data, segments)
        owner_cls = owner.cls if isinstance(owner, mi.StructType) else None
        return ConfigProblem(kind, join_path(full, key), detail, key=key, owner=owner_cls)
    detail = what[:1].lower() + what[1:]
    if key_error:
        detail = f"a key: {detail}"
    elif detail.startswith("expected") and "got" not in detail:
        value = _value_at(data, segments)
        if value is not _MISSING:
            detail += f", got {value!r}"
    elif detail.startswith("invalid enum value") and not field:
        declared = _type_at(cls, data, segments)
        if isinstance(declared, mi.EnumType):
            detail += f"; expected one of {[member.value for member in declared.cls]}"
        elif isinstance(declared, mi.LiteralType):
            detail += f"; expected one of {list(declared.values)}"
    return ConfigProblem(ProblemKind.INVALID, full or "<root>", detail)


def _pick(node: mi.Type, data: object) -> mi.Type:
    """The struct a union of structs (tagged, or Optional) means for `data`."""
    if not isinstance(node, mi.UnionType):
        return node
    structs = [t for t in node.types if isinstance(t, mi.StructType)]
    for struct in structs:
        if struct.tag_field is not None and isinstance(data, Mapping) and data.get(struct.tag_field) == struct.tag:
            return struct
    return structs[0] if len(structs) == 1 else node


def _type_at(cls: type, data: object, segments: list[str | int]) -> mi.Type:
    """The declared type at `segments` inside `cls` (for `data`, which picks tagged union members)."""
    node: mi.Type = _type_info(cls)
    for segment in segments:
        node = _pick(node, data)
        if isinstance(node, mi.StructType) and isinstance(segment, str):
            node = next((f.type for f in node.fields if f.encode_name == segment), mi.AnyType())
        elif isinstance(node, (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)):
            node = node.item_type
        elif isinstance(node, mi.DictType):
            node = node.value_type
        else:
            return mi.AnyType()
        data = _value_at(data, [segment])
    node = _pick(node, data)
    if isinstance(node, mi.UnionType):  # Optional[X]: X
        others = [t for t in node.types if not isinstance(t, mi.NoneType)]
        node = others[0] if len(others) == 1 else node
    return node


def _admits_null(node: mi.Type) -> bool:
    options = node.types if isinstance(node, mi.UnionType) else (node,)
    return any(isinstance(t, (mi.NoneType, mi.AnyType)) for t in options)


def _null_is_default(node: mi.Type, data: object) -> object:
    """`data` without the nulls that stand for a default (keys whose field cannot be null)."""
    node = _pick(node, data)
    if isinstance(node, mi.StructType) and isinstance(data, Mapping):
        fields = {f.encode_name: f for f in node.fields}
        result = {}
        for key, value in data.items():
            info = fields.get(key)
            if info is None:
                result[key] = value  # msgspec names it
            elif value is None and not info.required and not _admits_null(info.type):
                continue
            else:
                result[key] = _null_is_default(info.type, value)
        return result
    if isinstance(node, (mi.ListType, mi.VarTupleType)) and isinstance(data, (list, tuple)):
        return [_null_is_default(node.item_type, item) for item in data]
    return data
