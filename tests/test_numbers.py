"""One source per number: a figure the README or the docs quote from a results file is written as a link to
the value, ``[73.5%](docs/results/demo.json#/runs/2026-12-01/anchor)`` (a JSON pointer after the ``#``),
and every such quote must read what the file holds, to the digits it shows. The files are written by the
scripts that measured them (``bench/publish_run.py``, ``bench/vs_trl.py --out``, ``bench/stability_verdicts.py
--json``), so a rerun that changes a number changes it in one place, and this test names every copy left behind."""

from __future__ import annotations

import json
import re
import urllib.parse
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
QUOTE = re.compile(r"\[([^\]]+)\]\(([^)#\s]+\.json)#(/[^)\s]*)\)")
NUMBER = re.compile(r"^([+-]?\d+(?:\.(\d+))?)(e[+-]?\d+)?\s*(%|x|s| s| GiB| GB| MiB| MB| points)?$")


def pointer(doc: object, path: str) -> object:
    """RFC 6901: ``/a/b/0`` into nested mappings and lists (``~1`` is ``/``, ``~0`` is ``~``), from a link's
    fragment, so percent-encoded (``%7C`` for a key's ``|``, which a markdown table cell cannot hold)."""
    for part in urllib.parse.unquote(path).lstrip("/").split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


def shown(text: str, value: object) -> str | None:
    """Why a quote's text does not read ``value`` (None when it does): a number to the digits it shows, a
    percentage of a fraction, a ratio with its ``x``, or any other text as is."""
    m = NUMBER.match(text.strip())
    if m is None or not isinstance(value, int | float):
        return None if text.strip() == str(value) else f"{text!r} but the file holds {value!r}"
    digits = len(m.group(2) or "")
    scaled = value * 100 if m.group(4) in ("%", " points") else value
    if m.group(3):  # 4e-5, 4.4e-05: the mantissa's digits
        want = f"{scaled:.{digits}e}"
        return None if float(m.group(1) + m.group(3)) == float(want) else f"{text!r} but the file holds {want}"
    want = f"{scaled:.{digits}f}"
    return None if m.group(1).lstrip("+") == want.lstrip("+") else f"{text!r} but the file holds {want}"


def quotes() -> list[tuple[str, str, Path, str]]:
    """Every linked quote of a results file: (where, text, file, pointer)."""
    out = []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for m in QUOTE.finditer(line):
                where = f"{doc.relative_to(ROOT)}:{n}"
                out.append((where, m.group(1), (doc.parent / m.group(2)).resolve(), m.group(3)))
    return out


def test_the_checker_reads_digits_percentages_and_ratios():
    assert shown("73.5%", 0.735) is None and shown("0.43x", 0.4312) is None and shown("16.0 s", 15.96) is None
    assert shown("+8.7 points", 0.08712) is None and shown("+8.8 points", 0.08712) is not None
    assert shown("4e-5", 4.4e-05) is None and shown("4.4e-05", 4.4e-05) is None and shown("5e-5", 4.4e-05)
    assert shown("73.5%", 0.74) == "'73.5%' but the file holds 74.0"
    assert shown("AMD EPYC 7B13", "AMD EPYC 7B13") is None and shown("Xeon", "AMD EPYC") is not None
    assert pointer({"runs": {"a/b": [1, {"x": 2}]}}, "/runs/a~1b/1/x") == 2
    assert pointer({"k|sampler|32": {"grad_bias": 0.1}}, "/k%7Csampler%7C32/grad_bias") == 0.1


def test_the_docs_quote_results_files():
    files = {f for _, _, f, _ in quotes()}
    assert {ROOT / "docs" / "results" / "demo.json", ROOT / "docs" / "results" / "vs_trl.json"} <= files


@pytest.mark.parametrize(("where", "text", "path", "ptr"), quotes(), ids=lambda v: str(v)[:60])
def test_every_quoted_number_is_the_one_in_its_file(where, text, path, ptr):
    assert path.is_file(), f"{where}: {path} does not exist"
    try:
        value = pointer(json.loads(path.read_text()), ptr)
    except (KeyError, IndexError, ValueError) as e:
        pytest.fail(f"{where}: {path.name}#{ptr} names nothing in the file ({e!r})")
    problem = shown(text, value)
    assert problem is None, f"{where}: quotes {problem} ({path.name}#{ptr})"


DEMO = ("68.5%", "73.5%", "71.5%", "75.5%")


def test_the_demo_is_quoted_only_from_its_record():
    """The demo's accuracies appear in README and docs only as linked quotes of docs/results/demo.json
    (a number written out by hand is the copy that goes stale); other runs that happen to share a value
    say which run they are on the same line (vllm, peak, a different session's sampler)."""
    stray = []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            bare = QUOTE.sub("", line)
            for number in DEMO:
                if number in bare and not re.search(r"vllm|vLLM|peak|previous sampler|HF `generate`", bare):
                    stray.append(f"{doc.relative_to(ROOT)}:{n}: {number}")
    assert stray == []


# A measured number in a results row: a decimal, an exponent, or a number with a unit (a count of seeds, steps or
# problems is a setting of the run, not something it measured). A setting written after its name (lr 5e-5, beta
# 0.05, eta 0.9, k = 32) and the interval's level ("95% interval") are not measurements.
MEASURED = re.compile(r"(?<![\w.])[+-]?\d[\d,]*(\.\d+)?(e[+-]?\d+)?(%| ?x\b| s\b| ?GiB| ?GB| ?MiB| ?MB| points| nats)?")
SETTING = re.compile(r"(?:\b(?:lr|beta|eta|top-p|temperature)|(?<![\w-])k)(?: =)? ?$")
RESULTS_TABLES = (("README.md", "## Results"), ("docs/RESULTS.md", "## Current results"))


def unlinked(cell: str) -> list[str]:
    """The measured numbers of a table cell that are not a linked quote (code spans and dates aside)."""
    bare = re.sub(r"`[^`]*`|\b\d{4}-\d{2}-\d{2}\b", "", QUOTE.sub("LINKED", cell))
    return [m.group(0) for m in MEASURED.finditer(bare) if any(m.groups())
            and not SETTING.search(bare[:m.start()])
            and not bare[m.start():].startswith(("95% interval", "95% t-interval"))]


def results_rows() -> list[tuple[str, str]]:
    """(where, result cell) of each row of the tables that say what emapg reaches: the README's results and
    RESULTS.md's table of current results."""
    out = []
    for name, heading in RESULTS_TABLES:
        lines = (ROOT / name).read_text(encoding="utf-8").splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith(heading))
        for n in range(start + 1, len(lines)):
            if lines[n].startswith("#"):
                break
            cells = lines[n].split(" | ")
            if lines[n].startswith("| ") and len(cells) >= 3 and not lines[n].startswith("| what |"):
                out.append((f"{name}:{n + 1}", cells[1]))
    return out


def test_the_unlinked_number_check_sees_ranges_units_and_settings():
    assert unlinked("2.9x-50x less variance, 1.01x-2.29x forward") == ["2.9x", "50x", "1.01x", "2.29x"]
    assert unlinked("[+8.7 points](a.json#/x) at lr 5e-5 (95% interval [1](a.json#/y)), beta 0.05, k = 32") == []
    assert unlinked("86.0 / 86.8 / 93.0% on 100 problems, 8 seeds, 2026-12-05, `tests/test_kl.py`") == \
        ["86.0", "86.8", "93.0%"]
    assert unlinked("exact to 1e-12, 566 / 291 / 203 MiB, 4.56 against 11.3") == ["1e-12", "203 MiB", "4.56", "11.3"]
    assert unlinked("renormalised top-k 15% at k = 32") == ["15%"]


@pytest.mark.parametrize(("where", "cell"), results_rows(), ids=lambda v: str(v)[:40])
def test_every_number_a_results_row_measured_is_a_linked_quote(where, cell):
    """A measured number in a results row is a link to the file its script wrote, so a rerun that changes it
    changes it in one place and test_every_quoted_number_is_the_one_in_its_file holds the copy: one written by
    hand ("2.9x-50x" changed to "4.9x-90x") fails here."""
    assert unlinked(cell) == [], f"{where}: unlinked measured numbers"


def test_the_estimator_familys_summary_is_what_its_rows_give(bench_module):
    """docs/results/estimator_lab_family_summary.json, whose ranges the results rows quote, is bench/estimator_lab.py's
    summary of the family run beside it (``--summarize``): every range recomputed from the rows."""
    lab = bench_module("estimator_lab")
    results = ROOT / "docs" / "results"
    family = json.loads((results / "estimator_lab_family.json").read_text())
    assert lab.summary(family) == json.loads((results / "estimator_lab_family_summary.json").read_text())
    # a made-up family: the residual's variance 1/4 of the unbiased tail's everywhere but one row (1/10)
    rows = {}
    for name in ("topk_reverse", "topk_forward"):
        for head in ("sampler", "anchor"):
            for k in lab.KS:
                for form, var in (("unbiased", 4.0), ("residual", 1.0), ("paper", 2.0), ("bucket", 0.0)):
                    rows[lab.key(name, head, form, k)] = {"grad_var": var, "grad_bias": 0.01 * k, "head": head}
    rows[lab.key("k3pp", None, "unbiased", 0)] = {"grad_var": 8.0, "grad_bias": 0.0, "head": None}
    other = {k: dict(v) for k, v in rows.items()}
    other[lab.key("topk_reverse", "sampler", "residual", 4)]["grad_var"] = 0.4
    got = lab.summary({"a": {"estimators": rows}, "b": {"estimators": other}})
    assert got["reverse_sampler_unbiased_over_residual_var"] == {"min": 4.0, "max": 10.0, "rows": 8}
    assert got["forward_residual_over_paper_var"] == {"min": 0.5, "max": 0.5, "rows": 16, "above_1": 0}
    assert got["reverse_sampler_bucket_grad_bias_k32"]["max"] == 0.32
    assert got["reverse_sampler_unbiased_over_k3pp_var_k32"] == {"a": 0.5, "b": 0.5}
