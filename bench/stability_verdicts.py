"""Judge the stability study's pre-stated hypotheses (docs/RESULTS.md, H1-H5) from its finished runs.

Each hypothesis is a statement about a paired difference over seeds (the same seed's runs share their
prompts and sampling seeds): its mean and 95% t-interval, from `emapg compare`'s own summary. A
directional claim "holds" when the interval excludes 0 in the stated direction, "fails" when it excludes
0 in the other, and is "undecided" otherwise; H5's claim of no difference holds when every interval
includes 0. With fewer seeds than the study's, a verdict is marked provisional.
Last, one cut made after seeing the runs, reported and not judged: EMA-PG's final anchor minus its
policy, by whether the run ended below its policy's peak.

    python bench/study_records.py restore docs/results/stability runs/stability
    python bench/stability_verdicts.py --out runs/stability        # prints the markdown table
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from emapg.compare import anchor_minus_policy, load_spec, paired_diffs, summarize
from emapg.config import ConfigError

SPEC = Path(__file__).resolve().parent / "stability.yaml"


@dataclass(frozen=True)
class Claim:
    """One paired difference and the sign a hypothesis states for it (+1 above 0, -1 below, 0 none,
    "no lower": the interval includes 0 or lies above it)."""

    text: str
    config: str
    ref: str | None  # None: the config's anchor minus its own policy
    metric: str  # policy, anchor, peak, drawdown, auc (per-seed values of compare's summary); unused without ref
    sign: int | str


HYPOTHESES: dict[str, list[Claim]] = {
    "H1": [Claim("drawdown: EMA-PG beta 0.05 minus no KL < 0", "ema-0.05", "no-kl", "drawdown", -1)],
    "H2": [Claim(f"final anchor minus its policy > 0: {c}", c, None, "final", +1)
           for c in ("no-kl", "ema-0.001", "ema-0.05", "ema-0.2", "no-kl-hi", "ema-0.05-hi")],
    "H3": [Claim("peak: frozen beta 0.2 minus no KL < 0", "frozen-0.2", "no-kl", "peak", -1),
           Claim("peak: EMA-PG beta 0.2 minus no KL, not below 0", "ema-0.2", "no-kl", "peak", "no lower")],
    "H4": [Claim("final policy, lr 5e-5: EMA-PG minus no KL > 0", "ema-0.05-hi", "no-kl-hi", "policy", +1),
           Claim("final policy, lr 5e-5: EMA-PG minus frozen > 0", "ema-0.05-hi", "frozen-0.05-hi", "policy", +1)],
    "H5": [Claim("final policy: EMA-PG beta 0.001 minus no KL = 0", "ema-0.001", "no-kl", "policy", 0),
           Claim("drawdown: EMA-PG beta 0.001 minus no KL = 0", "ema-0.001", "no-kl", "drawdown", 0)],
}


def claim_verdict(diffs: list[float], sign: int | str) -> str:
    """holds / fails / undecided for one claim from its seed-by-seed differences."""
    if len(diffs) < 2:
        return "undecided"
    lo, hi = interval95(diffs)
    if sign == 0:
        return "holds" if lo <= 0 <= hi else "fails"
    if sign == "no lower":
        return "fails" if hi < 0 else "holds"
    above, below = lo > 0, hi < 0
    if (sign > 0 and above) or (sign < 0 and below):
        return "holds"
    if (sign > 0 and below) or (sign < 0 and above):
        return "fails"
    return "undecided"


def combine(verdicts: list[str]) -> str:
    """A hypothesis made of several claims holds when all hold and fails when any fails."""
    if "fails" in verdicts:
        return "fails"
    return "holds" if verdicts and all(v == "holds" for v in verdicts) else "undecided"


def claim_diffs(summary: dict[str, Any], claim: Claim) -> tuple[list[str], list[float]] | None:
    """The claim's seed-by-seed differences, or None when a config it needs has no finished run."""
    if claim.config not in summary or (claim.ref is not None and claim.ref not in summary):
        return None
    if claim.ref is None:
        return anchor_minus_policy(summary[claim.config])
    return paired_diffs(summary[claim.config], summary[claim.ref], claim.metric)


def verdicts(summary: dict[str, Any], seeds: int) -> tuple[list[str], dict[str, str]]:
    """The markdown table (one row per claim) and each hypothesis's verdict."""
    rows = ["| hypothesis | claim | seeds | mean (points) | 95% interval | claim's verdict |", "|" + "---|" * 6]
    result = {}
    for name, claims in HYPOTHESES.items():
        found, counts = [], []  # each claim's verdict and its number of seeds
        for c in claims:
            got = claim_diffs(summary, c)
            counts.append(len(got[1]) if got else 0)
            if not counts[-1]:
                rows.append(f"| {name} | {c.text} | 0 | n/a | n/a | undecided |")
                found.append("undecided")
                continue
            _, diffs = got
            v = claim_verdict(diffs, c.sign)
            found.append(v)
            interval = "n/a" if len(diffs) < 2 else "[{:+.1f}, {:+.1f}]".format(*(100 * x for x in interval95(diffs)))
            mean = round(100 * statistics.fmean(diffs), 1) + 0.0  # + 0.0: no "-0.0"
            rows.append(f"| {name} | {c.text} | {len(diffs)} | {mean:+.1f} | {interval} | {v} |")
        n = min(counts)  # the seeds behind every claim
        verdict = combine(found)
        result[name] = verdict if n >= seeds else f"{verdict} (provisional: {n} of {seeds} seeds)"
    return rows, result


EMA_PG = ("ema-0.001", "ema-0.05", "ema-0.2", "ema-0.05-hi")  # the configs with an EMA anchor in the loss


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/stability"), help="the study's output folder")
    ap.add_argument("--spec", type=Path, default=SPEC)
    args = ap.parse_args(argv)
    try:
        spec = load_spec(args.spec)
    except ConfigError as e:
        sys.exit(f"stability_verdicts: {e}")
    if not args.out.is_dir():
        sys.exit(f"stability_verdicts: {args.out} is not a folder (restore the kept records first)")
    summary = summarize(spec, args.out)
    rows, result = verdicts(summary, len(spec.seeds))
    print("\n".join(rows))
    print()
    print("\n".join(f"- **{h}**: {v}" for h, v in result.items()))
    print()
    print("Post hoc (not pre-stated): EMA-PG runs' final anchor minus policy, by whether the run passed its peak:")
    print("\n".join(past_peak(summary)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
