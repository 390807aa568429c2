"""The config reference, generated from the declarations: every field of :mod:`emapg.config.schema` with its
type, default, rule, whether a resume may change it, the ``emapg eval`` option and TRL keyword that set it, and
its docstring. ``emapg config`` prints it; ``docs/CONFIG.md`` is the same text as markdown
(``emapg config --markdown``; a test fails when the two differ), so the reference cannot drift from the code."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from typing import Any, get_type_hints

import yaml

from emapg.config import schema
from emapg.config.loading import to_dict
from emapg.config.schema import TrainConfig
from emapg.settings import declared


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str  # dotted: algo.eta
    type: str
    default: str
    rule: str
    replay_safe: bool
    option: str | None
    trl: str | None
    doc: str


def _docstrings() -> dict[tuple[str, str], tuple[str, str]]:
    """(class, field) -> (its annotation as written, the docstring below it), read from the schema's source."""
    out = {}
    for node in ast.parse(inspect.getsource(schema)).body:
        if not isinstance(node, ast.ClassDef):
            continue
        body = node.body
        for i, item in enumerate(body):
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                doc = ""
                if i + 1 < len(body) and isinstance(body[i + 1], ast.Expr) and isinstance(
                        getattr(body[i + 1], "value", None), ast.Constant) and isinstance(body[i + 1].value.value, str):
                    doc = body[i + 1].value.value
                out[(node.name, item.target.id)] = (ast.unparse(item.annotation), " ".join(doc.split()))
    return out


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    return "null" if value is None else repr(value).replace("'", "") if isinstance(value, list | dict) else (
        str(value).lower() if isinstance(value, bool) else str(value))


def entries() -> list[Entry]:
    """Every config field, in declaration order."""
    docs, sections = _docstrings(), get_type_hints(TrainConfig)
    out = []
    for name, f in declared(TrainConfig).items():
        section = name.split(".")[0] if "." in name else None
        owner = "TrainConfig" if section is None else sections[section].__name__
        annotation, doc = docs.get((owner, f.name), ("", ""))
        rule = f.metadata.get("rule")
        out.append(Entry(name=name, type=annotation, default=_default(f), rule=str(rule[1]) if rule else "",
                         replay_safe=bool(f.metadata.get("replay_safe")), option=f.metadata.get("option"),
                         trl=f.metadata.get("trl"), doc=doc))
    return out


def _facts(e: Entry) -> str:
    facts = [f"default `{e.default}`"]
    if e.rule:
        facts.append(e.rule)
    facts.append("a resume may change it" if e.replay_safe else "a resume changes it only with --force")
    if e.option:
        facts.append(f"`emapg eval {e.option}`")
    if e.trl:
        facts.append(f"TRL: `EMAPGTrainer({e.trl}=...)`")
    return "; ".join(facts)


def text(width: int = 100) -> str:
    """The reference as `emapg config` prints it: a block per field."""
    lines = []
    for e in entries():
        lines.append(f"{e.name}: {e.type}  ({_facts(e).replace('`', '')})")
        lines += textwrap.wrap(e.doc, width, initial_indent="    ", subsequent_indent="    ") if e.doc else []
    return "\n".join(lines) + "\n"


def markdown() -> str:
    """docs/CONFIG.md: every field by section, generated (`emapg config --markdown > docs/CONFIG.md`)."""
    out = ["# Config reference", "",
           "Generated from `src/emapg/config/schema.py` by `emapg config --markdown > docs/CONFIG.md` (a test fails "
           "when they differ). A config is YAML; any field is also an override on the command line "
           "(`algo.eta=0.95`). `emapg config --show CONFIG [KEY=VALUE ...]` prints the config a run would use, "
           "resolved. Rules across fields (a micro-batch that must divide its mini-batch, say) are checked when a "
           "config loads, each blamed on its field.", ""]
    section = None
    for e in entries():
        head = e.name.split(".")[0] if "." in e.name else "top level"
        if head != section:
            section = head
            out += [f"## {section}", ""]
        out += [f"- **`{e.name}`** ({e.type}): {_facts(e)}.", *([f"  {e.doc}"] if e.doc else []), ""]
    return "\n".join(out).rstrip() + "\n"


def resolved(cfg: Any) -> str:
    """The YAML of a loaded config, every field at its value (what the run's config.yaml would hold)."""


    return yaml.safe_dump(to_dict(cfg), sort_keys=False)

