"""How many seeds a pre-registered study needs, from its pilot: the rule studies/opd_tails/PREREGISTRATION.md
states, computed from the pilot's runs.

    python bench/pilot_seeds.py --study studies/opd_tails --pilot runs/opd-tails-pilot

For each claim of the study's spec, the pilot's seed-by-seed paired differences of the claim's metric;
sigma = the largest of their standard deviations; delta = ``--rel-delta`` (10%) of the claims' reference
configuration's mean pilot value; n = the smallest number of seeds in ``--min``..``--max`` with
(t(1 - alpha, n - 1) + t(power, n - 1))^2 (sigma / delta)^2 <= n, where alpha is the first Holm step's
one-sided level (0.025 over the family's claims). Prints sigma, delta and n (or the maximum, marked
underpowered) for PREREGISTRATION.md and the study's ``seeds``.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from emapg.stats import t_sf


def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t with ``df`` degrees of freedom (p in (0.5, 1)), by bisection on t_sf."""
    lo, hi = 0.0, 1000.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_sf(mid, df) > 1 - p else (lo, mid)
    return (lo + hi) / 2


def seeds_needed(sigma: float, delta: float, alpha: float, power: float = 0.8, low: int = 5,
                 high: int = 10) -> tuple[int, bool]:
    """(n, enough): the smallest n in low..high with a one-sided paired t-test at ``alpha`` reaching ``power``
    for a true difference ``delta`` when the differences' standard deviation is ``sigma``; (high, False)
    when none does."""
    for n in range(max(low, 2), high + 1):
        if (t_quantile(1 - alpha, n - 1) + t_quantile(power, n - 1)) ** 2 * (sigma / delta) ** 2 <= n:
            return n, True
    return high, False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--study", required=True, help="the study's folder (spec.yaml with hypotheses, pilot.yaml)")
    p.add_argument("--pilot", required=True, help="the pilot's output folder (emapg compare --out)")
    p.add_argument("--rel-delta", type=float, default=0.10)
    p.add_argument("--delta", type=float, help="the smallest difference worth detecting, absolute (instead of "
                   "--rel-delta of the claims' one reference's mean)")
    p.add_argument("--family", help="only this family's claims (default: every claim of the spec)")
    p.add_argument("--power", type=float, default=0.8)
    p.add_argument("--min", type=int, default=5)
    p.add_argument("--max", type=int, default=10)
    args = p.parse_args()
    from emapg.lab import verdicts as vd
    from emapg.lab.report import summarize
    from emapg.lab.study import load_spec

    study = Path(args.study)
    alpha, hyps = vd.load_hypotheses(study / "spec.yaml")
    summary = summarize(load_spec(study / "pilot.yaml"), Path(args.pilot))
    claims = [c for h in hyps if args.family in (None, h.family) for c in h.claims]
    sds, refs = [], set()
    for c in claims:
        seeds, diffs = vd.paired_diffs(summary[c.config], summary[c.ref], c.metric)
        if len(diffs) < 2:
            raise SystemExit(f"{c.text}: {len(diffs)} paired pilot seed(s); the rule needs 2 or more")
        sds.append(statistics.stdev(diffs))
        refs.add((c.ref, c.metric))
        print(f"{c.text}: pilot differences {', '.join(f'{d:+.5f}' for d in diffs)} (seeds {', '.join(seeds)})")
    if args.delta is not None:
        sigma, delta, said = max(sds), args.delta, "stated"
    else:
        (ref, metric), = refs
        ref_mean = statistics.fmean(v[metric] for v in summary[ref]["per_seed"].values() if v.get(metric) is not None)
        sigma, delta = max(sds), args.rel_delta * abs(ref_mean)
        said = f"{args.rel_delta:.0%} of {ref}'s mean {metric} {ref_mean:.5f}"
    first = alpha / 2 / len(claims)  # the one-sided level of Holm's first step over the family
    n, enough = seeds_needed(sigma, delta, first, args.power, args.min, args.max)
    print(f"sigma {sigma:.5f}, delta {delta:.5f} ({said}), "
          f"one-sided alpha {first:g}, power {args.power:.0%}: {n} seeds" + ("" if enough else " (underpowered)"))


if __name__ == "__main__":
    main()
