"""The paper's recipes against the reference scripts: docs/REPRODUCE.md's tables list every argument of the
four reference scripts (kept in tests/fixtures/reference_flags/) with its value, and the emapg field and value
that say the same; each recipe must hold exactly the values its tables give, and name no setting they leave out."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from emapg.config import load_config
from emapg.config.loading import _extended

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "REPRODUCE.md"
FLAGS = Path(__file__).resolve().parent / "fixtures" / "reference_flags"
MARK = re.compile(r"<!-- reference: (.*?) \| recipes: (.*?) -->")


def tables() -> list[dict]:
    """Each marked table: its scripts (or none), its recipes, and its rows split into cells."""
    lines = DOC.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        m = MARK.fullmatch(line.strip())
        if not m:
            continue
        scripts = [] if m[1].strip() == "—" else m[1].split()
        recipes = m[2].split()
        j = i + 1
        while not lines[j].startswith("|"):
            j += 1
        head = [c.strip() for c in lines[j].strip("|").split("|")]
        assert len(head) == 2 * len(recipes) + 3, f"table after line {i + 1}: {len(head)} columns"
        rows = []
        for row in lines[j + 2:]:
            if not row.startswith("|"):
                break
            cells = [c.strip() for c in row.strip().strip("|").split("|")]
            assert len(cells) == len(head), f"{DOC.name}: row {row[:60]!r} has {len(cells)} cells, not {len(head)}"
            rows.append(cells)
        out.append({"scripts": scripts, "recipes": recipes, "rows": rows, "line": i + 1})
    return out


TABLES = tables()


def value(cfg, field: str):
    node = cfg
    for part in field.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return node


def recipe_leaves(name: str) -> dict:
    """The settings a recipe file states (with those of the recipes it extends)."""
    path = ROOT / "recipes" / f"{name}.yaml"
    data = _extended(yaml.safe_load(path.read_text()), path, (path.resolve(),))

    def flat(d, pre=""):
        for k, v in d.items():
            yield from flat(v, f"{pre}{k}.") if isinstance(v, dict) else [(f"{pre}{k}", v)]

    return dict(flat(data))


def test_the_doc_has_the_tables_of_both_reference_runs():
    scripts = {s for t in TABLES for s in t["scripts"]}
    assert scripts == {p.stem for p in FLAGS.glob("*.txt")} == {"math_8k", "math_16k", "math_24k", "search"}
    recipes = {r for t in TABLES for r in t["recipes"]}
    assert recipes == {"math_r1_distill_1p5b", "math_r1_distill_1p5b_16k", "math_r1_distill_1p5b_24k",
                       "search_qwen2p5_3b"}


@pytest.mark.parametrize("script", sorted(p.stem for p in FLAGS.glob("*.txt")))
def test_every_argument_of_each_reference_script_is_in_its_table_with_its_value(script):
    table = next(t for t in TABLES if script in t["scripts"])
    column = 1 + table["scripts"].index(script)
    listed = {(r[0], r[column]) for r in table["rows"] if r[column] != "—"}
    given = {tuple(line.split("=", 1)) for line in (FLAGS / f"{script}.txt").read_text().splitlines() if line}
    assert given - listed == set(), f"{script}: arguments missing from docs/REPRODUCE.md (or with another value)"
    assert listed - given == set(), f"{script}: docs/REPRODUCE.md lists arguments the script does not pass"


@pytest.mark.parametrize("table", TABLES, ids=lambda t: f"line{t['line']}")
def test_each_recipe_holds_the_values_its_table_gives(table):
    n = len(table["recipes"])
    for j, recipe in enumerate(table["recipes"]):
        cfg = load_config(ROOT / "recipes" / f"{recipe}.yaml")
        for row in table["rows"]:
            field, cell = row[1 + n], row[2 + n + j]
            if field == "—":
                assert cell == "—", f"{row[0]}: a recipe value without an emapg field"
                continue
            if cell == "—":  # the field is set in another recipe of this table only
                continue
            want = yaml.safe_load(cell)
            got = value(cfg, field)
            assert got == want, f"{recipe}: {field} = {got!r}; the table ({row[0]}) says {want!r}"


@pytest.mark.parametrize("recipe", sorted({r for t in TABLES for r in t["recipes"]}))
def test_a_recipe_states_nothing_the_tables_leave_out(recipe):
    named = set()
    for t in TABLES:
        if recipe in t["recipes"]:
            j = t["recipes"].index(recipe)
            n = len(t["recipes"])
            named |= {r[1 + n] for r in t["rows"] if r[2 + n + j] != "—"}
    assert set(recipe_leaves(recipe)) - named == set(), f"{recipe}: settings no table of docs/REPRODUCE.md gives"


@pytest.mark.parametrize(("variant", "base", "differs"), [
    ("math_r1_distill_1p5b_topk", "math_r1_distill_1p5b", {"algo.kl": "topk_reverse", "algo.k": 32,
                                                           "algo.form": "unbiased"}),
    ("search_qwen2p5_3b_unbiased", "search_qwen2p5_3b", {"algo.form": "unbiased"}),
])
def test_the_variants_differ_from_the_reproduction_only_where_they_say(variant, base, differs):
    a, b = load_config(ROOT / "recipes" / f"{variant}.yaml"), load_config(ROOT / "recipes" / f"{base}.yaml")
    for field, want in differs.items():
        assert value(a, field) == want
        setattr(b.algo, field.split(".")[1], want)
    assert a == b
