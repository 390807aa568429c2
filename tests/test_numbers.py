"""One source per number: a figure the README or the docs quote from a results file is written as a link to
the value, ``[73.5%](docs/results/demo.json#/runs/2026-12-01/anchor)`` (a JSON pointer after the ``#``),
and every such quote must read what the file holds, to the digits it shows. The files are written by the
scripts that measured them (``bench/publish_run.py``, ``bench/vs_trl.py --out``, ``bench/stability_verdicts.py
--json``), so a rerun that changes a number changes it in one place, and this test names every copy left behind."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
QUOTE = re.compile(r"\[([^\]]+)\]\(([^)#\s]+\.json)#(/[^)\s]*)\)")
NUMBER = re.compile(r"^([+-]?\d+(?:\.(\d+))?)(e[+-]?\d+)?\s*(%|x|s| s| GiB| GB| MB| points)?$")


def pointer(doc: object, path: str) -> object:
    """RFC 6901: ``/a/b/0`` into nested mappings and lists (``~1`` is ``/``, ``~0`` is ``~``)."""
    for part in path.lstrip("/").split("/"):
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
