"""The math graders' bounds on model output, on and off, side by side in one run: seconds per completion and the
grade, for answers as competition golds are written and for completions a runaway model writes.

    python bench/grader_bounds.py --data DATA [--out docs/results/grader_bounds.json]

DATA: your folder of the published sets (math500.jsonl, olympiadbench.jsonl, minerva_math.jsonl, aime24.jsonl,
amc23.jsonl; docs/REPRODUCE.md says where each comes from).

Bounds on (what emapg runs): numbers over 10,000 digits are never computed (emapg.rewards.magnitude), the lenient
grader parses an answer within 1 s and compares a boxed answer longer than 500 characters and twice the gold's as
text. Bounds off: those three removed (math-verify's own 5 s per parse and per comparison, and the reference
grader's 5 s on sympy's simplification, stay). Each grader is called in this process's main thread, as a training
run calls it; one call per ordinary answer; for a runaway completion the median of --reps calls (one call with the
bounds off: each takes its time bound). Ordinary answers: equal forms written by hand, and every gold of the
published sets in --data (MATH-500, OlympiadBench, Minerva, AIME 2024, AMC 2023) boxed as the answer to its own
row and to the next row's, and 50 long MATH-500 completions without a box (eleven solutions each); their grades
must agree between on and off (the summary lists any that do not), and the largest digits bound among those
golds is reported beside the limit.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

from _common import ROOT, commit, machine

ORDINARY = [  # (gold, the answer a completion boxes): equal forms, and two wrong ones
    ("\\frac{1}{2}", "0.5"), ("3", "3"), ("24", "24"), ("142", "142.0"),
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}"),
    ("(-\\infty, -2) \\cup (3, \\infty)", "(-\\infty,-2)\\cup(3,\\infty)"),
    ("\\begin{pmatrix} 1 \\\\ -2 \\end{pmatrix}", "\\begin{pmatrix}1\\\\-2\\end{pmatrix}"),
    ("2^{2023}", "2^{2023}"), ("x^2+2x+1", "(x+1)^2"), ("\\frac{7}{12}", "7/12"), ("12\\sqrt{3}", "12\\sqrt3"),
    ("1, 2, 3", "1,2,3"), ("\\dfrac{\\pi}{4}", "\\frac{\\pi}{4}"), ("2023!", "2023!"), ("\\binom{10}{3}", "120"),
    ("10^{6}", "1000000"), ("y = 2x + 3", "y=2x+3"), ("(1, 2)", "(1,2)"), ("-\\frac{3}{4}", "-0.75"),
    ("\\frac{5\\sqrt{3}}{3}", "\\frac{5}{\\sqrt{3}}"), ("4\\pi", "4 \\pi"), ("e^{2}", "e^2"), ("90^\\circ", "90"),
    ("\\$18.90", "18.90"), ("5", "6"), ("\\frac{1}{3}", "0.33"),
]
RUNAWAY = {  # name: the completion
    "boxed_factorial": "\\boxed{99999999!}",
    "boxed_power_tower": "\\boxed{9**9**9}",
    "boxed_latex_tower": "\\boxed{10^{10^{10}}}",
    "boxed_gamma": "\\boxed{\\Gamma(10^{9})}",
    "boxed_tuple_35k": "\\boxed{(" + "1," * 35000 + "1)}",
    "boxed_open_x10k": "\\boxed{" * 10000,
    "boxed_70k_digits": "\\boxed{" + "1" * 70000 + "}",
}


def graders():
    """Each grader and the gold its runaway completions are graded against (the reference's integer test would
    refuse a runaway answer against an integer gold before any sympy work)."""
    from emapg.rewards.math import math_reward
    from emapg.rewards.math_reference import reference_math_reward

    return {"lenient": (math_reward, "1"), "reference": (reference_math_reward, "\\frac{1}{2}")}


def bounds(on: bool) -> None:
    """Switch the three bounds on or off in the graders' modules."""
    from emapg.rewards import magnitude, math, math_reference

    limit = (lambda e: False) if not on else magnitude.too_large
    math.too_large = math_reference.too_large = limit
    math.LONG_ANSWER, math.PARSE_SECONDS = (500, 1) if on else (10**9, 5)


def timed(fn, completion: str, gold: str, reps: int) -> tuple[float, float]:
    """Median seconds of ``reps`` calls, each with math-verify's parse caches emptied (a run's answers are new
    text), and the grade."""
    from math_verify.parser import parse_expr_cached, parse_latex_cached

    seconds, grade = [], None
    for _ in range(reps):
        parse_latex_cached.cache_clear()
        parse_expr_cached.cache_clear()
        t = time.perf_counter()
        grade = fn(completion, gold)
        seconds.append(time.perf_counter() - t)
    return statistics.median(seconds), grade


SETS = ("math500", "olympiadbench", "minerva_math", "aime24", "amc23")


def published_pairs(folder: Path) -> list[tuple[str, list[str], str]]:
    """(set, its golds, a completion) for every row of the published sets there: its own first gold boxed, and the
    next row's; and for every tenth MATH-500 row, a long completion without a box (ten other rows' solutions, then
    its own, each ``\\boxed{`` unwrapped), which the lenient grader reads whole."""
    import re

    from emapg.data import load_rows
    from emapg.tasks.math import math_rows

    pairs = []
    for name in SETS:
        path = folder / f"{name}.jsonl"
        if not path.exists():
            continue
        golds = [row["answer"] for row in math_rows(str(path), "problem", "answer")]
        for i, forms in enumerate(golds):
            pairs += [(name, forms, f"So \\boxed{{{forms[0]}}}."),
                      (name, forms, f"So \\boxed{{{golds[(i + 1) % len(golds)][0]}}}.")]
        if name == "math500":
            solutions = [re.sub(r"\\boxed\{", "{", row["solution"]) for row in load_rows(str(path))]
            for i in range(0, len(golds), 10):
                others = [solutions[(i + j) % len(solutions)] for j in range(1, 11)]
                pairs.append(("math500 unboxed", golds[i], "\n\n".join([*others, solutions[i]])))
    return pairs


def largest_gold_digits(pairs) -> float:
    from math_verify import parse

    from emapg.rewards.magnitude import digits_bound

    return max((digits_bound(f) for _, forms, _ in pairs for g in forms for f in parse(f"${g}$")
                if not isinstance(f, str)), default=0.0)


def measure(reps: int, pairs) -> dict:
    out = {"ordinary": [], "runaway": []}
    for name, (fn, runaway_gold) in graders().items():
        by_hand = [("by hand", [gold], f"So \\boxed{{{answer}}}.") for gold, answer in ORDINARY]
        for i, (source, golds, completion) in enumerate(by_hand + pairs):
            row = {"grader": name, "set": source, "gold": golds[0], "completion": completion[-200:]}
            gold = golds if name == "reference" else golds[0]
            for state in ("on", "off") if i % 2 else ("off", "on"):  # neither state always first (its warm-up)
                bounds(state == "on")
                row[f"seconds_{state}"], row[f"grade_{state}"] = timed(fn, completion, gold, 1)
            out["ordinary"].append(row)
        for case, completion in RUNAWAY.items():
            row = {"grader": name, "completion": case, "chars": len(completion)}
            for state in ("on", "off"):
                bounds(state == "on")
                row[f"seconds_{state}"], row[f"grade_{state}"] = timed(
                    fn, completion, runaway_gold, reps if state == "on" else 1)
            out["runaway"].append(row)
            print(f"{name:9s} {case:18s} on {row['seconds_on']:.3f} s  off {row['seconds_off']:.2f} s", flush=True)
    bounds(True)
    return out


def summary(out: dict, gold_digits: float) -> dict:
    from emapg.rewards.magnitude import DIGITS_LIMIT

    ordinary = out["ordinary"]
    by_set = {}
    for row in ordinary:
        by_set.setdefault(f"{row['grader']} {row['set']}", []).append(row)
    return {
        "ordinary_answers": len(ordinary),
        "ordinary_grades_differ": [r for r in ordinary if r["grade_on"] != r["grade_off"]],
        "largest_gold_digits_bound": gold_digits, "digits_limit": DIGITS_LIMIT,
        "ordinary_by_set": {name: {"answers": len(rows), **{f"graded_1_{s}": sum(r[f"grade_{s}"] for r in rows)
                                                            for s in ("on", "off")},
                                   **{f"median_seconds_{s}": statistics.median(r[f"seconds_{s}"] for r in rows)
                                      for s in ("on", "off")},
                                   "max_seconds_on": max(r["seconds_on"] for r in rows)}
                            for name, rows in by_set.items()},
        "ordinary_slowest": sorted(ordinary, key=lambda r: -r["seconds_on"])[:5],
        "runaway_max_seconds": {s: max(r[f"seconds_{s}"] for r in out["runaway"]) for s in ("on", "off")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--data", required=True, help="your folder of the published sets (math500.jsonl, ...)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "results" / "grader_bounds.json"))
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # math-verify's timeout warnings print whole completions
    pairs = published_pairs(Path(args.data))
    missing = [f"{n}.jsonl" for n in SETS if not (Path(args.data) / f"{n}.jsonl").exists()]
    if missing:  # a run without them measured 52 gradings, not 6,220, and would overwrite the record with that
        parser.error(f"--data {args.data}: no {', '.join(missing)} (the measurement grades every published set's "
                     "golds; docs/REPRODUCE.md says where each comes from)")
    out = measure(args.reps, pairs)
    record = {"machine": machine(), "commit": commit(), "reps": args.reps, "data": args.data,
              "summary": summary(out, largest_gold_digits(pairs)), "runaway": out["runaway"]}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: v for k, v in record["summary"].items() if k != "ordinary_slowest"}, indent=1))


if __name__ == "__main__":
    main()
