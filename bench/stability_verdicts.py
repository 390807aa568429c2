"""Judge a study's pre-stated hypotheses from its finished runs: raw and corrected verdicts side by side.

The hypotheses, their families and alpha are declared in the study's spec (``studies/NAME/spec.yaml``);
`emapg.lab.verdicts` computes, per claim, the mean seed-by-seed difference with its 95% t-interval, the
one-sided t-test and exact sign-flip permutation p-values, both Holm-adjusted within the claim's family,
and the raw (interval) and corrected (Holm) verdicts. With fewer seeds than the study's, a verdict is
marked provisional. For the 2026-11 stability study, last, one cut made after seeing the runs: EMA-PG's
final anchor minus its policy, by whether the run ended below its policy's peak (reported, not judged).

    python bench/study_records.py restore studies/stability/records runs/stability
    python bench/stability_verdicts.py --study studies/stability --out runs/stability   # prints the tables

``--json FILE`` writes the same verdicts as data (each claim's mean, interval and p-values in the metric's own
scale), the file the docs link their quoted numbers to (``studies/NAME/verdicts.json``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from emapg.config import ConfigError
from emapg.lab.report import summarize
from emapg.lab.study import load_spec
from emapg.lab.verdicts import anchor_minus_policy, judge, load_hypotheses, record, table

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


def endpoints(summary: dict[str, Any], hypotheses) -> dict[str, Any]:
    """Each config's values of the metrics the claims compare: mean, std and each seed's (fractions for
    accuracies, nats per token for the teacher KL)."""
    metrics = sorted({c.metric for h in hypotheses for c in h.claims if c.ref is not None})
    out = {}
    for name, s in summary.items():
        per = {m: {k: v[m] for k, v in s["per_seed"].items() if v.get(m) is not None} for m in metrics}
        out[name] = {"label": s["label"], "seeds": s["seeds"],
                     **{m: {"mean": statistics.fmean(vals.values()),
                            "std": statistics.stdev(vals.values()) if len(vals) > 1 else 0.0, "per_seed": vals}
                        for m, vals in per.items() if vals}}
    return out


def report(study: Path, out: Path, json_path: Path | None = None) -> str:
    """The verdicts' markdown for the study in folder ``study`` whose runs are in ``out`` (and, with
    ``json_path``, the same verdicts as data there)."""
    spec_path = study / "spec.yaml"
    spec = load_spec(spec_path)
    alpha, hypotheses = load_hypotheses(spec_path)
    if not hypotheses:
        raise ConfigError(f"{spec_path}: declares no hypotheses")
    summary = summarize(spec, out)
    judged = judge(summary, hypotheses, alpha)
    md = table(judged, hypotheses, len(spec.seeds), alpha)
    if json_path is not None:
        data = {"study": study.name, "judged": dt.date.today().isoformat(),
                "command": f"python bench/stability_verdicts.py --study studies/{study.name} --out {out}",
                **record(judged, hypotheses, len(spec.seeds), alpha), "configs": endpoints(summary, hypotheses)}
        tmp = json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(json_path)
    if study.name == "stability":
        md += ("\n\nPost hoc (not pre-stated): EMA-PG runs' final anchor minus policy, by whether the run passed "
               "its peak:\n" + "\n".join(past_peak(summary)))
    return md


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--study", type=Path, default=STUDIES / "stability", help="the study's folder (its spec.yaml)")
    ap.add_argument("--out", type=Path, default=Path("runs/stability"), help="the study's runs")
    ap.add_argument("--json", type=Path, help="also write the verdicts as data here (studies/NAME/verdicts.json)")
    args = ap.parse_args(argv)
    if not args.out.is_dir():
        sys.exit(f"stability_verdicts: {args.out} is not a folder (restore the kept records first: "
                 f"python bench/study_records.py restore {args.study / 'records'} {args.out})")
    try:
        print(report(args.study, args.out, args.json))
    except ConfigError as e:
        sys.exit(f"stability_verdicts: {e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
