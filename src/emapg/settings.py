"""How a setting is declared and read: a field's type and default, and on the same line every fact about it.

A field of the schema (:mod:`emapg.config.schema`) is ``name: type = setting(default, rule=..., ...)`` with its
docstring below it. ``setting`` keeps what the rest of emapg needs to know about the field in the dataclass
field's ``metadata``, and :mod:`emapg.config.rules` derives its tables from there (nothing else lists fields by
name):

- ``rule``: the values it takes, a :data:`Rule` (built with :func:`one_of`, :func:`at_least`, :func:`above`,
  :func:`within`, or by hand); checked when a config loads, for every option and keyword that sets the field
  elsewhere (``emapg eval``, the TRL plug-in) and for a task's own ``ARGS``.
- ``across``: rules across fields, blamed on this one: ``[(ok(cfg), message(cfg)), ...]``, checked after every
  field's own rule holds.
- ``replay_safe``: a resume may change it without changing what the resumed steps replay (how long, how often
  to save, where metrics go); any other change needs ``--force``.
- ``option``: the ``emapg eval`` option that sets it (``--samples``): its value is checked by this rule and a
  problem is named by the option.
- ``trl``: the ``EMAPGTrainer`` keyword that sets it (``eta``), checked by this rule.

:func:`typed` reads a mapping (a YAML file's) into such a dataclass: each value's type, each field's rule,
unknown and missing keys, every problem in one ConfigError. This module is pure (no torch, no registry): a task's
``ARGS`` and a backend's settings are declared and read with it too.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Callable, Iterable
from typing import Any, Union, get_args, get_origin, get_type_hints

from emapg.errors import ConfigError

Rule = tuple[Callable[[Any], bool], Any]
"""(whether a value is valid, what is expected: shown with ``str()``)."""

Across = tuple[Callable[[Any], bool], Callable[[Any], str]]
"""A rule across fields: (whether the whole config is valid, the message naming what is wrong)."""


def setting(default: Any = dataclasses.MISSING, *, factory: Callable[[], Any] | None = None, rule: Rule | None = None,
            across: Iterable[Across] = (), replay_safe: bool = False, option: str | None = None,
            trl: str | None = None) -> Any:
    """A schema field: ``default`` (or ``factory`` for a list, a mapping or a section) and its facts (see the
    module's docstring). A field of a section that is ``replay_safe`` is too."""
    meta = {"rule": rule, "across": tuple(across), "replay_safe": replay_safe, "option": option, "trl": trl}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


class _Names:
    """The message of a rule over a registry, read when it is shown: a name registered later (a user's own
    estimator, tail, advantage or aggregation) is listed and accepted."""

    def __init__(self, names: Iterable[str], what: str):
        self.names, self.what = names, what

    def __str__(self) -> str:
        return f"{self.what or 'expected one of'} {', '.join(self.names)}"


def one_of(names: Iterable[str], what: str = "") -> Rule:
    """A value among ``names``: a registry (a dict, read at each check) or a fixed list."""
    names = names if isinstance(names, dict) else tuple(names)
    return (lambda v: isinstance(v, str) and v in names), _Names(names, what)


def at_least(low: float, null: bool = False, finite: bool = False) -> Rule:
    return (lambda v: (null and v is None) or (v is not None and (not finite or math.isfinite(v)) and v >= low)), \
        f"must be {'a finite number ' if finite else ''}>= {low:g}" + (" or null" if null else "")


def above(low: float, null: bool = False, finite: bool = False) -> Rule:
    return (lambda v: (null and v is None) or (v is not None and (not finite or math.isfinite(v)) and v > low)), \
        f"must be {'a finite number ' if finite else ''}> {low:g}" + (" or null" if null else "")


def within(low: float, high: float, low_open: bool = False, high_open: bool = False, null: bool = False) -> Rule:
    def ok(v):
        if v is None:
            return null
        return (low < v if low_open else low <= v) and (v < high if high_open else v <= high)

    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    return ok, f"must be in {interval}" + (" or null" if null else "")


def rule_problems(rules: dict[str, Rule], values: dict[str, Any], names: dict[str, str] | None = None,
                  prefix: str = "") -> list[str]:
    """Each value that breaks its rule in ``rules``, as ``NAME: expected ..., got VALUE`` (``prefix`` + the
    name, or the option ``names`` gives for it). The config's table and each task's ``ARGS`` are checked so."""
    problems = []
    for name, value in values.items():
        ok, expected = rules[name]
        try:
            good = ok(value)
        except TypeError:  # a value of another type, given directly (the TRL plug-in's arguments)
            good = False
        if not good:
            shown = prefix + name
            if names and name in names:  # an option: null is the config's word for "not set"
                shown, expected = names[name], str(expected).removesuffix(" or null")
            problems.append(f"{shown}: {expected}, got {value!r}")
    return problems


def all_of(problems: list[str], partial: Any = None) -> ConfigError:
    """One error for every problem found: ``a: ...; b: ...`` (one line); ``partial``: what was built from the
    valid fields."""
    return ConfigError("; ".join(problems), problems, partial)


Moved = dict[str, dict[str, str]] | None
"""Keys an earlier version had, by section (a dotted name, "" for the top level): old key -> where it is now."""


def moved_hint(moved: Moved, where: str, keys: set[str]) -> str:
    """`` (a.b is now c.d; ...)`` for the keys ``moved`` knows in section ``where``, else ""."""
    known = (moved or {}).get(where, {})
    hints = [f"{where + '.' if where else ''}{k} is now {known[k]}" for k in sorted(keys) if k in known]
    return f" ({'; '.join(hints)})" if hints else ""


def _type_name(typ: Any) -> str:
    if get_origin(typ) in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in get_args(typ))
    if get_origin(typ) is not None:
        return str(typ).replace("typing.", "")
    return getattr(typ, "__name__", str(typ))


def _coerce(value: Any, typ: Any, where: str, moved: Moved) -> Any:
    """Check/convert a YAML value to the declared type; raise ConfigError naming ``where``."""
    if typ is Any:
        return value
    if get_origin(typ) in (Union, types.UnionType):  # X | None: the only unions the config declares
        if value is None and type(None) in get_args(typ):
            return None
        (inner,) = [a for a in get_args(typ) if a is not type(None)]
        if value is None:
            raise ConfigError(f"{where}: must not be null (expected {_type_name(typ)})")
        return _coerce(value, inner, where, moved)
    if value is None:
        raise ConfigError(f"{where}: must not be null (expected {_type_name(typ)})")
    if dataclasses.is_dataclass(typ):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of {typ.__name__} fields, got {value!r}")
        return typed(typ, value, where, moved)
    origin = get_origin(typ) or typ
    if origin is bool and isinstance(value, bool):
        return value
    if origin is bool:
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if origin is list:
        (item,) = get_args(typ)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list of {_type_name(item)}, got {value!r}")
        return [_coerce(v, item, f"{where}[{i}]", moved) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        item = get_args(typ)[1] if get_args(typ) else Any
        return {k: _coerce(v, item, f"{where}.{k}", moved) for k, v in value.items()}
    if origin is float and isinstance(value, str):
        try:  # YAML 1.1 reads 1e-5 (no dot) as a string
            return float(value)
        except ValueError:
            pass
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if origin is float and number:
        return float(value)
    if (origin is int and number and isinstance(value, int)) or (origin is str and isinstance(value, str)):
        return value
    raise ConfigError(f"{where}: expected {_type_name(typ)}, got {value!r}")


def typed(cls, data: dict[str, Any], where: str = "", moved: Moved = None):
    """``data`` read into the dataclass ``cls``: each value coerced to its declared type and checked by its field's
    rule (``where``: the dotted name of ``data`` in its file), unknown and missing keys named; one ConfigError for
    every problem, carrying what was built from the valid fields (``partial``; None without a required one).
    ``moved``: keys an earlier emapg had, by section, and where they are now (named beside an unknown key). Every
    file emapg reads as settings (a config, a study's spec, a backend's settings) goes through here."""
    hints, declared = get_type_hints(cls), {f.name: f for f in dataclasses.fields(cls)}
    problems, kwargs = [], {}
    unknown = set(data) - set(hints)
    if unknown:
        problems.append(f"{where or 'top level'}: unknown key(s) {', '.join(sorted(unknown))}; "
                        f"known: {', '.join(hints)}" + moved_hint(moved, where, unknown))
    required = {k for k, f in declared.items() if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING}
    missing = [k for k in declared if k in required and k not in data]
    problems += [f"{where}.{k}: missing (required)" if where else f"{k}: missing (required)" for k in missing]
    for k, v in data.items():
        if k in hints:
            name = f"{where}.{k}" if where else k
            try:
                kwargs[k] = _coerce(v, hints[k], name, moved)
            except ConfigError as e:  # every wrong field is reported, not only the first
                problems += e.problems
                if e.partial is not None:  # a section with wrong fields: its valid ones are still checked
                    kwargs[k] = e.partial
                continue
            if (rule := declared[k].metadata.get("rule")) is not None:
                problems += rule_problems({name: rule}, {name: kwargs[k]})
    if problems:
        raise all_of(problems, cls(**kwargs) if required <= set(kwargs) else None)
    return cls(**kwargs)


def declared(cls: type, prefix: str = "") -> dict[str, dataclasses.Field]:
    """Every field of a schema dataclass and of its sections, by dotted name (``algo.eta``), in declaration
    order; a section's ``replay_safe`` passes to its fields."""
    hints = get_type_hints(cls)
    out: dict[str, dataclasses.Field] = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            inner = declared(hints[f.name], f"{prefix}{f.name}.")
            if f.metadata.get("replay_safe"):
                inner = {n: _replay_safe(g) for n, g in inner.items()}
            out.update(inner)
        else:
            out[prefix + f.name] = f
    return out


def across_rules(cls: type) -> list[tuple[str, Callable[[Any], bool], Callable[[Any], str]]]:
    """The rules across fields of a schema dataclass and its sections: (the field an error names, whether the whole
    is valid, its message), in declaration order."""
    return [(name, ok, message) for name, f in declared(cls).items() for ok, message in f.metadata.get("across", ())]


def _replay_safe(f: dataclasses.Field) -> dataclasses.Field:
    g = dataclasses.field(metadata={**f.metadata, "replay_safe": True})
    g.name, g.type = f.name, f.type
    return g
