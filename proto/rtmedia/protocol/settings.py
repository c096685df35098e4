"""Declarative settings sections: one dataclass per part of a configuration, each field declared
once with its default, help text, flag and checks (`setting`), from which the command-line
flags (one argparse group per section), the flat deploy-file keys and their validation are all
generated.

A section's field `threads` of a section with prefix `asr_` has the flat key `asr_threads` (the
deploy file's key and the argparse dest) and the flag `--asr-threads`; a field may name its key,
its flags and deprecated spellings explicitly. A root configuration (a dataclass of sections)
is built from flat keys (`root_from_flat`) or from nested section mappings (`asr: {threads: 2}`);
an unknown key fails naming it. This module imports nothing of rtmedia, so every door may build
its sections on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import MISSING, dataclass
from typing import Any, ClassVar, TypeVar

S = TypeVar("S", bound="Section")

NUMBER = (int, float)


@dataclass(frozen=True)
class Spec:
    """How one field is set and checked (its default lives on the dataclass field)."""

    help: str = ""
    key: str | None = None  # the flat key; default: the section's prefix + the field's name
    flags: tuple[str, ...] = ()  # option strings; default: --KEY with dashes
    deprecated: tuple[str, ...] = ()  # old spellings that still work and print one line naming flags[0]
    aliases: tuple[str, ...] = ()  # short spellings some commands also take (`add_flags(aliases=True)`)
    metavar: str | None = None
    choices: tuple[Any, ...] | None = None  # checked on every value
    cli_choices: tuple[Any, ...] | None = None  # only the flag's (the value is checked where it is used)
    flag_choices: tuple[Any, ...] | None = None
    low: float | None = None  # inclusive bounds of a number
    high: float | None = None
    above: float | None = None  # an exclusive lower bound (a positive number: above=0)
    finite: bool = False  # a number below infinity
    kind: str | None = None  # "int", "float", "str", "bool", "ints", "strs", "map_float", "map_floats"
    flag_value: Any = None  # what a flag without a value stores (booleans: not the default)
    check: Callable[[Any], bool] | None = None  # a further predicate on the value
    message: str | None = None  # the error; {key} and {value} (repr: {value!r}) are filled in
    cli_type: Callable[[str], Any] | None = None  # the argparse type of the flag's value
    cli: bool = True  # False: no flag (a value only the deploy file can give)


def setting(default: Any = MISSING, *, factory: Callable[[], Any] | None = None, **spec: Any) -> Any:
    """A dataclass field with its Spec: `setting(4, help="...", low=1)`."""
    metadata = {"spec": Spec(**spec)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _kind(spec: Spec, default: Any) -> str:
    if spec.kind:
        return spec.kind
    if isinstance(default, bool):
        return "bool"
    if isinstance(default, int):
        return "int"
    if isinstance(default, float):
        return "float"
    if isinstance(default, list):
        return "ints" if default and all(isinstance(x, int) for x in default) else "strs"
    return "str"


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None


@dataclass(frozen=True)
class FieldInfo:
    """A section field as generation sees it."""

    name: str
    key: str
    spec: Spec
    kind: str
    default: Any

    @property
    def flags(self) -> tuple[str, ...]:
        return self.spec.flags or (f"--{self.key.replace('_', '-')}",)


def _is_number(value: Any) -> bool:
    return isinstance(value, NUMBER) and not isinstance(value, bool)


def _type_error(info: FieldInfo, value: Any) -> str | None:
    if value is None:
        return None
    if info.kind == "int" and not (_is_number(value) and float(value).is_integer()):
        return f"{info.key} must be a whole number, got {value!r}"
    if info.kind == "float" and not _is_number(value):
        return f"{info.key} must be a number, got {value!r}"
    if info.kind == "bool" and not isinstance(value, bool):
        return f"{info.key} must be true or false, got {value!r}"
    return None


def field_error(info: FieldInfo, value: Any) -> str | None:
    """The error one value of the field makes by itself, or None."""
    spec = info.spec

    def fail(default: str) -> str:
        return (spec.message or default).format(key=info.key, value=value)

    if spec.message and (error := _type_error(info, value)):
        return fail(error)
    if error := _type_error(info, value):
        return error
    if value is None:
        return None
    if spec.choices is not None and value not in spec.choices:
        return fail(f"{{key}} must be one of {', '.join(map(str, spec.choices))}, got {{value!r}}")
    if _is_number(value):
        if spec.low is not None and spec.high is not None and not spec.low <= value <= spec.high:
            return fail(f"{{key}} must be within {spec.low:g}..{spec.high:g}, got {{value}}")
        if spec.low is not None and value < spec.low:
            return fail(f"{{key}} must be at least {spec.low:g}, got {{value}}")
        if spec.above is not None and not value > spec.above:
            return fail(f"{{key}} must be above {spec.above:g}, got {{value}}")
        if spec.finite and not value < math.inf:
            return fail("{key} must be a finite number, got {value!r}")
    if spec.check is not None and not spec.check(value):
        return fail("{key}: {value!r} is not a valid value")
    return None


class Section:
    """A settings section: a dataclass whose fields are `setting`s. Construction checks each field
    by its Spec, then the section's own cross-field rules (`check`); a ValueError names the key."""

    PREFIX: ClassVar[str] = ""
    TITLE: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for info in self.fields():
            if error := field_error(info, getattr(self, info.name)):
                raise ValueError(error)
        self.check()

    def check(self) -> None:
        """Rules between this section's fields (none by default)."""

    @classmethod
    def fields(cls) -> list[FieldInfo]:
        out = []
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            spec = f.metadata.get("spec", Spec())
            default = _default(f)
            out.append(FieldInfo(f.name, spec.key or f"{cls.PREFIX}{f.name}", spec, _kind(spec, default), default))
        return out

    @classmethod
    def keys(cls) -> dict[str, str]:
        """Flat key -> field name."""
        return {info.key: info.name for info in cls.fields()}

    @classmethod
    def of(cls: type[S], **flat: Any) -> S:
        """The section from flat keys (`asr_threads=2`); an unknown key fails naming it."""
        keys = cls.keys()
        if unknown := sorted(set(flat) - set(keys)):
            raise ValueError(f"unknown setting(s): {', '.join(unknown)}; known: {', '.join(sorted(keys))}")
        return cls(**{keys[k]: v for k, v in flat.items()})

    def flat(self) -> dict[str, Any]:
        """The section as flat keys."""
        return {info.key: getattr(self, info.name) for info in self.fields()}

    def to_json(self) -> str:
        return json.dumps(self.flat())

    @classmethod
    def from_json(cls: type[S], text: str) -> S:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"{cls.__name__}: expected a JSON object, got {text[:80]!r}")
        return cls.of(**data)

    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser | Any, title: str | None = None,
                  aliases: bool = False) -> Any:
        """This section's flags, in an argument group of their own; each dest is the flat key and
        each default None (a flag not given leaves the deploy file's value, else the default)."""
        group = parser.add_argument_group(title or cls.TITLE)
        for info in cls.fields():
            if info.spec.cli:
                add_flag(group, info, aliases)
        return group

    @classmethod
    def given(cls, args: argparse.Namespace) -> dict[str, Any]:
        """The flat keys of the flags given in `args` (None: not given)."""
        return {k: getattr(args, k) for k in cls.keys() if getattr(args, k, None) is not None}

    @classmethod
    def from_args(cls: type[S], args: argparse.Namespace) -> S:
        return cls.of(**cls.given(args))


# ---- flags ------------------------------------------------------------------------------------------


class _Setting(argparse.Action):
    """Stores one setting; a deprecated spelling prints one line naming the flag to use."""

    def __init__(self, *args: Any, primary: str = "", deprecated: tuple[str, ...] = (),
                 mode: str = "store", **kwargs: Any) -> None:
        self.primary, self.deprecated, self.mode = primary, deprecated, mode
        super().__init__(*args, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if option_string in self.deprecated:
            print(f"{parser.prog}: {option_string} is deprecated; use {self.primary}", file=sys.stderr)
        if self.mode == "const":
            value = self.const
        elif self.mode == "append":
            value = [*(getattr(namespace, self.dest) or []), values]
        elif self.mode == "map":
            name, _, text = str(values).partition("=")
            try:
                item = self.type_of_value(text)
            except ValueError:
                raise argparse.ArgumentError(self, f"expected {self.metavar}, got {values!r}") from None
            value = {**(getattr(namespace, self.dest) or {}), name.strip(): item}
        else:
            value = values
        setattr(namespace, self.dest, value)

    type_of_value: Callable[[str], Any] = float


def _floats(text: str) -> list[float]:
    values = [float(x) for x in text.split(",") if x.strip()]
    if not values:
        raise ValueError(text)
    return values


def positive_ints(text: str) -> list[int]:
    """`1,2,4`: positive integers separated by commas (an argparse type)."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return sizes


def positive_int(text: str) -> int:
    """A positive integer (an argparse type)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_flag(group: Any, info: FieldInfo, aliases: bool = False) -> None:
    spec = info.spec
    names = [*info.flags, *(spec.aliases if aliases else ()), *spec.deprecated]
    kwargs: dict[str, Any] = dict(dest=info.key, default=None, help=spec.help, action=_Setting,
                                  primary=info.flags[0], deprecated=spec.deprecated)
    if spec.metavar:
        kwargs["metavar"] = spec.metavar
    if info.kind == "bool":
        value = (not info.default) if spec.flag_value is None else spec.flag_value
        kwargs.update(nargs=0, const=value, mode="const")
        kwargs.pop("metavar", None)
    elif info.kind == "strs":
        kwargs.update(mode="append")
    elif info.kind in ("map_float", "map_floats"):
        kwargs.update(mode="map")
        kwargs.setdefault("metavar", "NAME=VALUE")
    else:
        kwargs["type"] = spec.cli_type or {"int": int, "float": float, "ints": positive_ints}.get(info.kind, str)
        if (choices := spec.choices or spec.cli_choices) is not None:
            kwargs["choices"] = list(choices)
    action = group.add_argument(*names, **kwargs)
    if info.kind == "map_floats":
        action.type_of_value = _floats


# ---- a root of sections -----------------------------------------------------------------------------


def sections(root_cls: type) -> dict[str, type[Section]]:
    """Section attribute name -> section class of a root dataclass (whose fields are sections)."""
    out = {}
    for f in dataclasses.fields(root_cls):
        cls = f.default_factory  # type: ignore[misc]
        if isinstance(cls, type) and issubclass(cls, Section):
            out[f.name] = cls
    return out


def flat_index(root_cls: type) -> dict[str, tuple[str, str]]:
    """Every flat key of a root -> (section attribute, field name)."""
    return {key: (attr, name) for attr, cls in sections(root_cls).items() for key, name in cls.keys().items()}


def split_flat(root_cls: type, values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Flat keys, or nested section mappings (`asr: {threads: 2}`, by field or flat key), grouped by
    section as flat keys; an unknown key fails naming it."""
    index, by_section = flat_index(root_cls), sections(root_cls)
    grouped: dict[str, dict[str, Any]] = {attr: {} for attr in by_section}
    unknown = []
    for key, value in values.items():
        if key in by_section and isinstance(value, dict):
            cls = by_section[key]
            names = {info.name: info.key for info in cls.fields()}
            for inner, item in value.items():
                flat = names.get(inner, inner)
                if flat in cls.keys():
                    grouped[key][flat] = item
                else:
                    unknown.append(f"{key}.{inner}")
        elif key in index:
            grouped[index[key][0]][key] = value
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"unknown setting(s): {', '.join(sorted(unknown))}; known: {', '.join(sorted(index))}")
    return grouped


def root_from_flat(root_cls: type, values: dict[str, Any]) -> Any:
    """A root built from flat (or nested) keys: each section from its own keys."""
    grouped = split_flat(root_cls, values)
    return root_cls(**{attr: sections(root_cls)[attr].of(**flat) for attr, flat in grouped.items()})


def iter_fields(root_cls: type) -> Iterator[tuple[str, FieldInfo]]:
    """(section attribute, field) of every field of a root."""
    for attr, cls in sections(root_cls).items():
        for info in cls.fields():
            yield attr, info
