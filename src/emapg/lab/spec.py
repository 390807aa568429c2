"""A study's spec file (the YAML `emapg compare` runs), declared as the training config is: typed dataclasses whose
fields carry their rules (:func:`emapg.config.setting`), read by the config's own reader, so that every problem
in a spec is named at once, by field, and blamed on the file.

The file: ``base`` (a config file, relative to the spec), ``overrides`` shared by every run, ``seeds``,
``configs`` (a plain name -> its overrides, or ``{label, overrides}``), ``groups`` of configs compared together,
``quick`` (a smaller version: more overrides, fewer seeds, some configs), ``prune_checkpoints``, and the
pre-stated ``hypotheses`` with their ``alpha`` (:mod:`emapg.lab.verdicts` judges them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from emapg.config import ConfigError, across_rules, setting, typed
from emapg.config.loading import load_yaml
from emapg.errors import not_utf8, regular_file

_OVERRIDES = ((lambda v: all("=" in o for o in v)), "expected a list of KEY=VALUE overrides")
_PLAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")


def _not_plain(configs: dict[str, Any]) -> list[str]:
    return [str(name) for name in configs if not _PLAIN.fullmatch(str(name))]


def _unknown(names: list[str], spec: SpecFile) -> list[str]:
    return sorted({str(n) for n in names} - {str(k) for k in spec.configs})


@dataclass
class ConfigEntry:
    """One configuration: its runs' overrides (after the spec's) and the label its tables and figures show."""

    overrides: list[str] = setting(factory=list, rule=_OVERRIDES)
    label: str | None = None


@dataclass
class QuickFile:
    """``--quick``: overrides added to every run, the seeds and the configs it keeps."""

    overrides: list[str] = setting(factory=list, rule=_OVERRIDES)
    seeds: list[int] | None = setting(None, rule=((lambda v: v is None or len(set(v)) == len(v)),
                                                  "repeats a seed (each seed is one run per config)"))
    only: list[str] | None = None


@dataclass
class ClaimFile:
    """A claim: config minus ref (same seed) of a per-seed metric, or a config's anchor minus its own policy
    (``ref`` omitted), with the sign it states."""

    text: str
    config: str
    metric: str
    sign: Any = setting(rule=((lambda v: v in (1, -1, 0, "no lower") and not isinstance(v, bool)),
                              "expected 1, -1, 0 or 'no lower'"))
    ref: str | None = None


@dataclass
class HypothesisFile:
    """A hypothesis: its claims, all in one ``family`` (the multiplicity correction's)."""

    claims: list[ClaimFile] = setting(factory=list, rule=((lambda v: len(v) > 0),
                                                          "expected a non-empty list of claims"))
    family: str = "all"


@dataclass
class SpecFile:
    """The spec file as written (paths relative to it, configs as given)."""

    base: str
    configs: dict[str, ConfigEntry] = setting(rule=((lambda v: len(v) > 0), "expected at least one config (a run "
                                                                            "each per seed)"), across=[
        (lambda s: not _not_plain(s.configs),
         lambda s: f"{', '.join(map(repr, _not_plain(s.configs)))}: not a plain name (letters, digits, _ . + -): each "
                   "names its runs' folder under --out")])
    overrides: list[str] = setting(factory=list, rule=_OVERRIDES)
    seeds: list[int] = setting(factory=lambda: [0], rule=((lambda v: len(v) > 0 and len(set(v)) == len(v)),
                                                          "repeats a seed or lists none (each seed is one run per "
                                                          "config)"))
    groups: dict[str, list[str]] = setting(factory=dict, across=[
        (lambda s: not _unknown([n for names in s.groups.values() for n in names], s),
         lambda s: f"unknown configs {_unknown([n for names in s.groups.values() for n in names], s)}; "
                   f"known: {', '.join(map(str, s.configs))}")])
    quick: QuickFile | None = setting(None, across=[
        (lambda s: s.quick is None or not _unknown(s.quick.only or [], s),
         lambda s: f"only: unknown configs {_unknown(s.quick.only or [], s)}; "
                   f"known: {', '.join(map(str, s.configs))}")])
    prune_checkpoints: bool = False
    alpha: float = setting(0.05, rule=((lambda v: 0 < v < 1), "expected a number in (0, 1)"))
    hypotheses: dict[str, HypothesisFile] = setting(factory=dict, across=[
        (lambda s: not _unknown(_claimed(s), s),
         lambda s: f"claims name unknown configs {_unknown(_claimed(s), s)}; known: {', '.join(map(str, s.configs))}")])


def _claimed(spec: SpecFile) -> list[str]:
    return [n for h in spec.hypotheses.values() for c in h.claims for n in (c.config, c.ref) if n is not None]


def read_spec_file(path: str | Path) -> SpecFile:
    """A spec file, read and checked by the config's machinery: one ConfigError naming the file and every field
    wrong (types, each field's rule, then the rules across fields)."""
    path = Path(path)
    regular_file(path, "--spec")
    try:
        raw = load_yaml(path.read_bytes().decode("utf-8"))
    except OSError as e:
        raise ConfigError(f"{path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}, {not_utf8(e)}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f", line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{line}: invalid YAML: {getattr(e, 'problem', e)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping with base, configs, seeds")
    configs = raw.get("configs")
    if isinstance(configs, dict):  # a config given as a bare list is its overrides
        raw = {**raw, "configs": {k: {"overrides": v} if isinstance(v, list) else v for k, v in configs.items()}}
    try:
        spec = typed(SpecFile, raw, "")
    except ConfigError as e:
        raise ConfigError(f"{path}: " + "; ".join(e.problems), [f"{path}: {p}" for p in e.problems]) from None
    problems = [f"{name}: {message(spec)}" for name, ok, message in across_rules(SpecFile) if not ok(spec)]
    if problems:
        raise ConfigError(f"{path}: " + "; ".join(problems), [f"{path}: {p}" for p in problems])
    return spec

