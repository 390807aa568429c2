"""Judge a study's pre-stated hypotheses from its finished runs: raw and corrected verdicts side by side.

The hypotheses, their families and alpha are declared in the study's spec (``studies/NAME/spec.yaml``);
`emapg.lab.verdicts` computes, per claim, the mean seed-by-seed difference with its 95% t-interval, the
one-sided t-test and exact sign-flip permutation p-values, both Holm-adjusted within the claim's family,
and the raw (interval) and corrected (Holm) verdicts. With fewer seeds than the study's, a verdict is
marked provisional. For the 2026-11 stability study, last, one cut made after seeing the runs: EMA-PG's
final anchor minus its policy, by whether the run ended below its policy's peak (reported, not judged).

    python bench/study_records.py restore studies/stability/records runs/stability
    python bench/stability_verdicts.py --study studies/stability --out runs/stability   # prints the tables
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from emapg.config import ConfigError
from emapg.lab.report import summarize
from emapg.lab.study import load_spec
from emapg.lab.verdicts import anchor_minus_policy, judge, load_hypotheses, table

STUDIES = Path(__file__).resolve().parents[1] / "studies"
EMA_PG = ("ema-0.001", "ema-0.05", "ema-0.2", "ema-0.05-hi")  # the 2026-11 study's configs with the EMA in the loss


def past_peak(summary: dict[str, Any], configs: tuple[str, ...] = EMA_PG) -> list[str]:
    """A cut made after seeing the runs, reported, not judged: each EMA-PG run's final anchor minus its
    policy (points), split by whether the run ended below its policy's peak (drawdown > 0) or at it."""
    below: list[int] = []
    at: list[int] = []
    for c in configs:
        if c not in summary:
            continue
        seeds, diffs = anchor_minus_policy(summary[c])
        for s, d in zip(seeds, diffs, strict=True):
            (below if summary[c]["per_seed"][s]["drawdown"] > 0 else at).append(round(100 * d))
    return [f"- {name}: {len(ds)} runs, the anchor at or above its policy in {sum(d >= 0 for d in ds)}"
            + ("" if not ds else ": " + ", ".join(f"{d:+d}" for d in ds))
            for name, ds in (("ended below the policy's peak", below), ("ended at the peak", at))]


def report(study: Path, out: Path) -> str:
    """The verdicts' markdown for the study in folder ``study`` whose runs are in ``out``."""
    spec_path = study / "spec.yaml"
    spec = load_spec(spec_path)
    alpha, hypotheses = load_hypotheses(spec_path)
    if not hypotheses:
        raise ConfigError(f"{spec_path}: declares no hypotheses")
    summary = summarize(spec, out)
    md = table(judge(summary, hypotheses, alpha), hypotheses, len(spec.seeds), alpha)
    if study.name == "stability":
        md += ("\n\nPost hoc (not pre-stated): EMA-PG runs' final anchor minus policy, by whether the run passed "
               "its peak:\n" + "\n".join(past_peak(summary)))
    return md


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--study", type=Path, default=STUDIES / "stability", help="the study's folder (its spec.yaml)")
    ap.add_argument("--out", type=Path, default=Path("runs/stability"), help="the study's runs")
    args = ap.parse_args(argv)
    if not args.out.is_dir():
        sys.exit(f"stability_verdicts: {args.out} is not a folder (restore the kept records first: "
                 f"python bench/study_records.py restore {args.study / 'records'} {args.out})")
    try:
        print(report(args.study, args.out))
    except ConfigError as e:
        sys.exit(f"stability_verdicts: {e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
