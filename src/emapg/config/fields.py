"""How a config field is declared: its type and default, and on the same line every fact about it.

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

This module is pure (no torch, no registry): the rule builders are also what a task's ``ARGS`` and a backend's
settings use.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any

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


def declared(cls: type, prefix: str = "") -> dict[str, dataclasses.Field]:
    """Every field of a schema dataclass and of its sections, by dotted name (``algo.eta``), in declaration
    order; a section's ``replay_safe`` passes to its fields."""
    from typing import get_type_hints

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
