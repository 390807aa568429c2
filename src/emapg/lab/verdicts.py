"""A study's pre-stated hypotheses, judged from its finished runs: raw and corrected verdicts.

A study's spec (the YAML `emapg compare` runs) may declare ``hypotheses``, each a list of claims in
one ``family``, and ``alpha``. A claim is a paired difference over seeds: config minus ref (same seed,
same prompts) of a per-seed metric, or a config's anchor minus its own policy (``ref`` omitted, metric
``final`` or ``last3``), or a difference each run already holds (``ref`` omitted, e.g. ``ema_gain``), with
the sign it states: +1 (above 0), -1 (below), 0 (no difference) or "no lower" (not below 0).

Raw verdict (as the study first stated it): a directional claim holds when the 95% t-interval excludes
0 in its direction, fails when it excludes 0 the other way, else is undecided. Corrected verdict: a
directional claim holds when its one-sided p-value, Holm-adjusted over all the directional claims of
its family (a claim without data counts as p = 1), is below alpha / 2, the same two-sided level as the
interval's, so a corrected verdict is never looser than the raw one; it fails when its raw verdict
fails. Both the t-test's and the exact sign-flip permutation test's p-values are adjusted and shown;
the corrected verdict is the t-test's (the study's stated test), the sign-flip column the
nonparametric check beside it. A claim of no difference is not
a test of an effect: no correction applies, and "holds" there means only that no difference was
detected. A hypothesis holds when all its claims hold and fails when any fails.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from emapg.lab.spec import read_spec_file
from emapg.stats import holm, interval95, sign_flip_p, t_pvalue


@dataclass(frozen=True)
class Claim:
    text: str
    config: str
    ref: str | None  # None: the config's anchor minus its own policy, or a within-run difference (ema_gain)
    metric: str  # a per-seed key of compare's summary; for an anchor claim: "final" or "last3"
    sign: int | str  # +1, -1, 0 or "no lower"

    @property
    def directional(self) -> bool:
        return self.sign in (1, -1)


@dataclass(frozen=True)
class Hypothesis:
    name: str
    family: str
    claims: list[Claim]


def load_hypotheses(path: str | Path) -> tuple[float, list[Hypothesis]]:
    """A spec's ``alpha`` (default 0.05) and ``hypotheses``, read with the rest of the spec
    (:func:`emapg.lab.spec.read_spec_file`: every problem named with its field and the file)."""
    spec = read_spec_file(path)
    return spec.alpha, [Hypothesis(str(name), h.family, [Claim(c.text, c.config, c.ref, c.metric, c.sign)
                                                         for c in h.claims]) for name, h in spec.hypotheses.items()]


def paired_diffs(run: dict[str, Any], ref: dict[str, Any], which: str) -> tuple[list[str], list[float]]:
    """Seed by seed, ``run``'s per-seed value of ``which`` (policy, anchor, peak, drawdown, auc) minus
    ``ref``'s, over the seeds both have: (seeds, differences)."""
    seeds = [k for k, v in run["per_seed"].items()
             if v.get(which) is not None and ref["per_seed"].get(k, {}).get(which) is not None]
    return seeds, [run["per_seed"][k][which] - ref["per_seed"][k][which] for k in seeds]


def anchor_minus_policy(run: dict[str, Any], endpoint: str = "") -> tuple[list[str], list[float]]:
    """Seed by seed, the anchor's accuracy minus its own policy's, same run: (seeds, differences). The
    final evaluation's, or with ``endpoint="_last3"`` the smoothed endpoint's."""
    a, p = f"anchor{endpoint}", f"policy{endpoint}"
    seeds = [k for k, v in run["per_seed"].items() if v.get(a) is not None and v.get(p) is not None]
    return seeds, [run["per_seed"][k][a] - run["per_seed"][k][p] for k in seeds]


def claim_diffs(summary: dict[str, Any], claim: Claim) -> tuple[list[str], list[float]] | None:
    """The claim's seed-by-seed differences, or None when a config it needs has no finished run."""
    if claim.config not in summary or (claim.ref is not None and claim.ref not in summary):
        return None
    if claim.ref is None and claim.metric in ("final", "last3"):
        return anchor_minus_policy(summary[claim.config], "" if claim.metric == "final" else f"_{claim.metric}")
    if claim.ref is None:  # a difference within each run already (e.g. ema_gain: its weight EMA minus its policy)
        seeds = [k for k, v in summary[claim.config]["per_seed"].items() if v.get(claim.metric) is not None]
        return seeds, [summary[claim.config]["per_seed"][k][claim.metric] for k in seeds]
    return paired_diffs(summary[claim.config], summary[claim.ref], claim.metric)


def raw_verdict(diffs: list[float], sign: int | str) -> str:
    """holds / fails / undecided from the 95% t-interval of the differences."""
    if len(diffs) < 2:
        return "undecided"
    lo, hi = interval95(diffs)
    if sign == 0:
        return "holds" if lo <= 0 <= hi else "fails"
    if sign == "no lower":
        return "fails" if hi < 0 else "holds"
    if (sign > 0 and lo > 0) or (sign < 0 and hi < 0):
        return "holds"
    if (sign > 0 and hi < 0) or (sign < 0 and lo > 0):
        return "fails"
    return "undecided"


def combine(verdicts: list[str]) -> str:
    if "fails" in verdicts:
        return "fails"
    return "holds" if verdicts and all(v == "holds" for v in verdicts) else "undecided"


@dataclass
class Judged:
    hypothesis: str
    claim: Claim
    seeds: int
    mean: float | None
    interval: tuple[float, float] | None
    p_t: float | None
    p_flip: float | None
    raw: str
    holm_t: float | None = None
    holm_flip: float | None = None
    corrected: str = "undecided"
    corrected_flip: str = "undecided"
    diffs: tuple[float, ...] = ()  # seed by seed, what the mean and the interval summarise


def judge(summary: dict[str, Any], hypotheses: list[Hypothesis], alpha: float = 0.05) -> list[Judged]:
    """Every claim's numbers and verdicts, Holm's correction applied within each family."""
    out = []
    for h in hypotheses:
        for c in h.claims:
            got = claim_diffs(summary, c)
            diffs = got[1] if got else []
            alt = "greater" if c.sign == 1 else "less"
            j = Judged(h.name, c, len(diffs), statistics.fmean(diffs) if diffs else None,
                       interval95(diffs) if len(diffs) >= 2 else None,
                       t_pvalue(diffs, alt) if c.directional and len(diffs) >= 2 else None,
                       sign_flip_p(diffs, alt) if c.directional and 0 < len(diffs) <= 20 else None,
                       raw_verdict(diffs, c.sign), diffs=tuple(diffs))
            if not c.directional:
                j.corrected = j.corrected_flip = j.raw  # no correction for a claim of no effect
            out.append(j)
    family_of = {h.name: h.family for h in hypotheses}
    for family in sorted(set(family_of.values())):
        mine = [j for j in out if family_of[j.hypothesis] == family and j.claim.directional]
        adj_t = holm({str(i): 1.0 if j.p_t is None else j.p_t for i, j in enumerate(mine)})
        adj_f = holm({str(i): 1.0 if j.p_flip is None else j.p_flip for i, j in enumerate(mine)})
        for i, j in enumerate(mine):
            if j.p_t is not None:
                j.holm_t = adj_t[str(i)]
                j.corrected = "fails" if j.raw == "fails" else "holds" if j.holm_t < alpha / 2 else "undecided"
            if j.p_flip is not None:
                j.holm_flip = adj_f[str(i)]
                j.corrected_flip = "fails" if j.raw == "fails" else "holds" if j.holm_flip < alpha / 2 else "undecided"
    return out


def _p(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}" if x >= 0.001 else f"{x:.1e}"


def unit(metric: str) -> tuple[str, float, int]:
    """How a claim's metric is shown: (unit, scale, decimals). Accuracies and their areas in points; the
    policy's KL to its teacher (``teacher_kl``, ``teacher_kl_last3``) in nats per token."""
    if metric.startswith("teacher_kl"):
        return "nats/token", 1.0, 5
    return "points", 100.0, 1


def _signed(x: float, scale: float, digits: int) -> str:
    return f"{round(scale * x, digits) + 0.0:+.{digits}f}"


def table(judged: list[Judged], hypotheses: list[Hypothesis], seeds: int, alpha: float = 0.05) -> str:
    """The claims' table and each hypothesis's raw and corrected verdict (markdown). Means and intervals in
    points, or with the unit named where the metric is not an accuracy (:func:`unit`)."""
    lines = [f"Holm's correction within each family; p-values one-sided in the claimed direction; a claim holds "
             f"corrected when its Holm p is below {alpha / 2:g} (two-sided {alpha:g}, the interval's level); claims "
             "of no difference: not corrected, 'holds' = no difference detected.", "",
             "| hypothesis (family) | claim | seeds | mean (points unless named) | 95% t-interval | p (t) | "
             "p (sign-flip) | Holm p (t) | Holm p (sign-flip) | raw verdict | corrected | corrected (sign-flip) |",
             "|" + "---|" * 12]
    family = {h.name: h.family for h in hypotheses}
    for j in judged:
        name, scale, digits = unit(j.claim.metric)
        named = "" if name == "points" else f" {name}"
        mean = "n/a" if j.mean is None else _signed(j.mean, scale, digits) + named
        ci = "n/a" if j.interval is None else f"[{_signed(j.interval[0], scale, digits)}, " \
                                              f"{_signed(j.interval[1], scale, digits)}]"
        lines.append(f"| {j.hypothesis} ({family[j.hypothesis]}) | {j.claim.text} | {j.seeds} | {mean} | {ci} | "
                     f"{_p(j.p_t)} | {_p(j.p_flip)} | {_p(j.holm_t)} | {_p(j.holm_flip)} | {j.raw} | "
                     f"{j.corrected} | {j.corrected_flip} |")
    lines.append("")
    for name, (raw, corrected, flip, n) in hypothesis_verdicts(judged, hypotheses).items():
        note = "" if n >= seeds else f" (provisional: {n} of {seeds} seeds)"
        lines.append(f"- **{name}**: raw {raw}, corrected {corrected} (sign-flip: {flip})" + note)
    return "\n".join(lines)


def hypothesis_verdicts(judged: list[Judged], hypotheses: list[Hypothesis]) -> dict[str, tuple[str, str, str, int]]:
    """Each hypothesis's (raw, corrected, corrected by sign-flip) verdict and the seeds behind all its claims."""
    out = {}
    for h in hypotheses:
        mine = [j for j in judged if j.hypothesis == h.name]
        out[h.name] = (combine([j.raw for j in mine]), combine([j.corrected for j in mine]),
                       combine([j.corrected_flip for j in mine]), min(j.seeds for j in mine))
    return out


def record(judged: list[Judged], hypotheses: list[Hypothesis], seeds: int, alpha: float = 0.05) -> dict[str, Any]:
    """The verdicts as data (what ``bench/stability_verdicts.py --json`` writes and the docs link to): per
    hypothesis its family, verdicts and seeds, and per claim the numbers in the metric's own scale (fractions
    for accuracies, nats per token for the teacher KL; ``unit`` says which the docs show) with its p-values."""
    out: dict[str, Any] = {"alpha": alpha, "seeds_planned": seeds, "hypotheses": {}}
    verdicts = hypothesis_verdicts(judged, hypotheses)
    for h in hypotheses:
        raw, corrected, flip, n = verdicts[h.name]
        claims = [{"text": j.claim.text, "config": j.claim.config, "ref": j.claim.ref, "metric": j.claim.metric,
                   "unit": unit(j.claim.metric)[0], "seeds": j.seeds, "mean": j.mean,
                   "interval95": list(j.interval) if j.interval else None, "p_t": j.p_t, "p_sign_flip": j.p_flip,
                   "holm_p_t": j.holm_t, "holm_p_sign_flip": j.holm_flip, "raw": j.raw, "corrected": j.corrected,
                   "corrected_sign_flip": j.corrected_flip}
                  for j in judged if j.hypothesis == h.name]
        out["hypotheses"][h.name] = {"family": h.family, "raw": raw, "corrected": corrected,
                                     "corrected_sign_flip": flip, "seeds": n, "provisional": n < seeds,
                                     "claims": claims}
    return out
