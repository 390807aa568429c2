"""A study's report: from its runs' metrics.jsonl, mean and spread over seeds of held-out accuracy,
reward, KL to the anchor, KL to the initial policy and entropy (a markdown table and one PNG figure per
group), paired differences seed by seed, the anchor against its own policy, problem-by-problem McNemar
tables, and, where the spec declares hypotheses, their verdicts (:mod:`emapg.lab.verdicts`)."""

from __future__ import annotations

import json
import math
import statistics
import textwrap
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from emapg.errors import EmapgError, regular_file
from emapg.lab.study import Spec
from emapg.lab.verdicts import Judged, anchor_minus_policy, judge, load_hypotheses, paired_diffs, table, unit
from emapg.run.metrics import METRIC_UNITS, draw_series, finish_axes, read_metrics
from emapg.run.outcomes import final_outcomes
from emapg.stats import interval95, mcnemar_p

CURVES = {  # panel title -> metrics key
    "held-out accuracy (policy)": "eval/policy_accuracy",
    "held-out accuracy (anchor)": "eval/anchor_accuracy",
    "reward": "reward_mean",
    "KL to the anchor (to the teacher when distilling)": "kl",
    "KL to the initial policy": "kl_to_init",
    "entropy": "entropy",
}
# a distillation study's panel, drawn where its runs measured it (eval.teacher_kl)
TEACHER_CURVES = {"KL to the teacher (held-out, exact)": "eval/policy_teacher_kl"}


def _curve(rows: list[dict[str, Any]], key: str) -> dict[int, float]:
    return {r["step"]: float(r[key]) for r in rows if isinstance(r.get(key), int | float) and math.isfinite(r[key])}


def _anchor_curve(rows: list[dict[str, Any]]) -> dict[int, float]:
    """The anchor's accuracy curve. Where it was evaluated along the way, the curve starts at step 0,
    where the anchor is the initial policy (evaluated as the policy); an anchor evaluated only at the
    end stays one point (no line drawn through steps it was not evaluated at)."""
    curve = _curve(rows, "eval/anchor_accuracy")
    init = _curve(rows, "eval/policy_accuracy").get(0)
    return {0: init, **curve} if len(curve) > 1 and 0 not in curve and init is not None else curve


def _last_steps(rows: list[dict[str, Any]], key: str, n: int = 5) -> list[float]:
    """``key``'s values over a run's last ``n`` steps."""
    end = rows[-1]["step"]
    return [r[key] for r in rows if key in r and r["step"] > end - n]


def _auc(curve: dict[int, float]) -> float:
    """The area under an accuracy curve over its steps (trapezoids), divided by the steps it spans:
    the curve's mean height, so runs of the same length compare."""
    steps = sorted(curve)
    if len(steps) < 2:
        return curve[steps[0]] if steps else math.nan
    area = sum((b - a) * (curve[a] + curve[b]) / 2 for a, b in zip(steps, steps[1:], strict=False))
    return area / (steps[-1] - steps[0])


SMOOTH = 3  # a smoothed endpoint: the mean of a curve's last this many evaluations


def endpoints(rows: list[dict[str, Any]]) -> dict[str, float]:
    """A run's per-seed endpoints besides the final evaluation: for the policy and the anchor on the
    held-out set (``policy_last3``, ``anchor_last3``) and on the transfer set (``transfer_policy``,
    ``transfer_policy_last3``, ...), the mean of the last three evaluations and the last one; for a
    distillation run the policy's exact reverse KL to its teacher (``teacher_kl``, ``teacher_kl_last3``). The
    anchor's curve counts only where it was evaluated (step 0 excluded: there it is the policy)."""
    out = {}
    for name, key in (("policy", "eval/policy_accuracy"), ("anchor", "eval/anchor_accuracy"),
                      ("ema", "eval/ema_accuracy"),
                      ("transfer_policy", "eval/transfer_policy_accuracy"),
                      ("transfer_anchor", "eval/transfer_anchor_accuracy"),
                      ("transfer_ema", "eval/transfer_ema_accuracy"),
                      ("teacher_kl", "eval/policy_teacher_kl")):
        curve = _curve(rows, key)
        values = [curve[s] for s in sorted(curve)]
        if len(values) >= SMOOTH:
            out[f"{name}_last{SMOOTH}"] = statistics.fmean(values[-SMOOTH:])
        if name.startswith(("transfer", "teacher")) and values:
            out[name] = values[-1]
    return {**out, **shipped(rows)}


def shipped(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The model a user would ship from a run with a weight EMA and a validation set: at the run's last
    evaluation, the weight EMA where its validation accuracy is above the policy's, else the policy (a tie
    keeps the policy); its test (held-out) accuracy ``shipped``, its transfer accuracy ``transfer_shipped``,
    ``shipped_is_ema`` (1 or 0), and ``ema_gain``, the EMA's test accuracy minus the policy's at that evaluation.
    The choice never reads the test set. {} for a run without both."""
    last = next((r for r in reversed(rows) if _number(r.get("eval/validation_ema_accuracy"))
                 and _number(r.get("eval/validation_policy_accuracy"))), None)
    if last is None:
        return {}
    ema = last["eval/validation_ema_accuracy"] > last["eval/validation_policy_accuracy"]
    which = "ema" if ema else "policy"
    out = {"shipped": last[f"eval/{which}_accuracy"], "shipped_is_ema": float(ema)}
    if _number(last.get("eval/ema_accuracy")) and _number(last.get("eval/policy_accuracy")):
        out["ema_gain"] = last["eval/ema_accuracy"] - last["eval/policy_accuracy"]  # on the test set, reported
    if _number(last.get(f"eval/transfer_{which}_accuracy")):
        out["transfer_shipped"] = last[f"eval/transfer_{which}_accuracy"]
    return out


def per_problem(spec: Spec, out: Path, a: str, b: str, model: str = "policy",
                which_set: str = "heldout") -> list[tuple[str, int, int, float]]:
    """Seed by seed, the exact McNemar test of config ``a``'s final ``model`` against ``b``'s on the same
    problems: (seed, problems only a solved, problems only b solved, two-sided p). Seeds without kept
    outcomes on both sides, or whose two runs were evaluated on different problems, are left out."""
    rows = []
    for s in spec.seeds:
        oa, ob = (final_outcomes(out / c / f"seed{s}", model, which_set) for c in (a, b))
        if oa is not None and ob is not None and oa[0] == ob[0]:
            rows.append((str(s), *mcnemar_p(oa[1], ob[1])))
    return rows


def _mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _EVAL_OK(d: Any) -> bool:  # noqa: N802 - a rule, named as the file it checks
    return (isinstance(d, dict) and isinstance(d.get("policy"), dict) and _number(d["policy"].get("accuracy"))
            and all(isinstance(d.get(k), dict | None) for k in ("init", "anchor")))


def _COMPUTE_OK(d: Any) -> bool:  # noqa: N802
    return isinstance(d, dict) and _number(d.get("seconds"))


def _run_json(file: Path, ok, shape: str) -> Any:
    """A run's JSON file as the report reads it, or one EmapgError naming the file and what it should hold."""
    try:
        regular_file(file)
        data = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise EmapgError(f"{file}: damaged ({type(e).__name__}: {e}); rerun that run (remove its folder)") from None
    if not ok(data):
        raise EmapgError(f"{file}: expected {shape}, got {json.dumps(data)[:80]}; rerun that run (remove its folder)")
    return data


def _rows(run: Path) -> list[dict[str, Any]]:
    rows = read_metrics(run)
    if not rows:
        raise EmapgError(f"{run / 'metrics.jsonl'}: no rows, in a run with an eval.json; rerun that run (remove its "
                         "folder)")
    return rows


def summarize(spec: Spec, out: Path) -> dict[str, Any]:
    """Per config: mean/std curves over seeds, final numbers, compute. Runs not finished are left out."""
    summary: dict[str, Any] = {}
    for name in spec.configs:
        done = [s for s in spec.seeds if (out / name / f"seed{s}" / "eval.json").exists()]
        runs = [out / name / f"seed{s}" for s in done]
        if not runs:
            continue
        metrics = [_rows(r) for r in runs]
        curves = {}
        for key in (*CURVES.values(), *TEACHER_CURVES.values()):
            per_seed = [_anchor_curve(m) if key == "eval/anchor_accuracy" else _curve(m, key) for m in metrics]
            steps = sorted(set.intersection(*(set(c) for c in per_seed))) if per_seed else []
            curves[key] = {"steps": steps,
                           "mean": [_mean_std([c[s] for c in per_seed])[0] for s in steps],
                           "std": [_mean_std([c[s] for c in per_seed])[1] for s in steps]}
        finals = [_run_json(r / "eval.json", _EVAL_OK, "{policy: {accuracy: N}, ...}") for r in runs]

        def accuracies(which: str, finals=finals) -> list[float]:
            return [f[which]["accuracy"] for f in finals if f.get(which) and f[which].get("accuracy") is not None]

        last = [m[-1] for m in metrics]
        tail = [statistics.fmean(_last_steps(m, "reward_mean")) for m in metrics]
        peak = [max(_curve(m, "eval/policy_accuracy").values()) for m in metrics]
        # only where the anchor was evaluated along the way, not just at the end
        anchor_auc = [_auc(c) if len(c := _anchor_curve(m)) > 1 else None for m in metrics]
        final = [f["policy"]["accuracy"] for f in finals]
        drawdown = [pk - fi for pk, fi in zip(peak, final, strict=True)]
        auc = [_auc(_curve(m, "eval/policy_accuracy")) for m in metrics]
        compute = [_run_json(r / "compute.json", _COMPUTE_OK, "{seconds: N}")["seconds"] for r in runs
                   if (r / "compute.json").exists()]
        ends = [endpoints(m) for m in metrics]
        summary[name] = {
            "label": spec.labels.get(name, name), "seeds": len(runs), "curves": curves,
            "init": _mean_std(accuracies("init")), "policy": _mean_std(accuracies("policy")),
            "anchor": _mean_std(accuracies("anchor")), "ema": _mean_std(accuracies("ema")),
            **{k: _mean_std([e[k] for e in ends if k in e]) for k in ("shipped", "shipped_is_ema")
               if any(k in e for e in ends)},
            "peak": _mean_std(peak), "drawdown": _mean_std(drawdown), "auc": _mean_std(auc),
            "reward_last5": _mean_std(tail),
            # a sampled estimate with single-step spikes: each run's median over its last 5 steps
            "kl_to_init": _mean_std([statistics.median(v) for m in metrics if (v := _last_steps(m, "kl_to_init"))]),
            "entropy": _mean_std([x["entropy"] for x in last if "entropy" in x]),
            "minutes": _mean_std([c / 60 for c in compute]),
            **{k: _mean_std([e[k] for e in ends if k in e]) for k in ("teacher_kl", "teacher_kl_last3")
               if any(k in e for e in ends)},
            "per_seed": {str(seed): {**{w: (f.get(w) or {}).get("accuracy") for w in ("policy", "anchor", "ema")},
                                     "peak": pk, "drawdown": dd, "auc": a, "anchor_auc": aa, **end}
                         for seed, f, pk, dd, a, aa, end in zip(done, finals, peak, drawdown, auc, anchor_auc, ends,
                                                                strict=True)},
        }
    return summary


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinity as null (JSON has none: strict parsers refuse them)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _pm(ms: tuple[float, float], scale: float = 100.0, digits: int = 1, spread: bool = True) -> str:
    """mean ± std; the mean alone when there is no spread to show (one seed)."""
    m, s = ms
    if math.isnan(m):
        return "n/a"
    return f"{scale * m:.{digits}f} ± {scale * s:.{digits}f}" if spread else f"{scale * m:.{digits}f}"


# The table's numeric columns after config and seeds: summary key, scale, decimals.
COLUMNS = (("init", 100, 1), ("policy", 100, 1), ("anchor", 100, 1), ("peak", 100, 1), ("drawdown", 100, 1),
           ("auc", 100, 1), ("reward_last5", 1, 3),
           ("kl_to_init", 1, 4), ("entropy", 1, 3), ("minutes", 1, 1))


def markdown(spec: Spec, summary: dict[str, Any]) -> str:
    """One table per group (or one table), mean ± std over seeds."""
    head = ("| config | seeds | initial acc % | final policy acc % | final anchor acc % | peak policy acc % | "
            "drawdown (peak - final) | policy AUC % | reward (last 5 steps) | KL to init (median, last 5 steps) | "
            "entropy (last step) | minutes per run |")
    sep = "|" + "---|" * 12
    groups = spec.groups or {"all": list(summary)}
    lines = []
    for group, names in groups.items():
        rows = [n for n in names if n in summary]
        if not rows:
            continue
        if spec.groups:
            lines += [f"**{group}**", ""]
        lines += [head, sep]
        for n in rows:
            s = summary[n]
            cells = [s["label"], str(s["seeds"])] + [_pm(s[k], x, d, spread=s["seeds"] > 1) for k, x, d in COLUMNS]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        lines += _paired(summary, rows)
        lines += _to_the_teacher(summary, rows)
    lines += _anchor_vs_policy(summary)
    return "\n".join(lines)


def _to_the_teacher(summary: dict[str, Any], rows: list[str]) -> list[str]:
    """A distillation study's endpoint: each config's exact reverse KL to its teacher on the teacher's held-out
    responses (nats per token), mean ± std over seeds at step 0, at the end and over the last three
    evaluations, and each config minus the group's first, seed by seed, with 95% t-intervals."""
    rows = [n for n in rows if "teacher_kl" in summary[n]]
    if not rows:
        return []
    ref = summary[rows[0]]
    lines = ["The policy's exact reverse KL to its teacher on the teacher's held-out responses (nats per token; "
             f"lower is closer), mean ± std over seeds; differences paired with {ref['label']} (same seed), mean "
             "± std [95% interval]:", "",
             "| config | step 0 | final | last 3 evaluations | final minus the first config's | last 3 minus the first "
             "config's | last 3 minus the first config's: per seed |", "|" + "---|" * 7]
    for n in rows:
        s = summary[n]
        curve = s["curves"]["eval/policy_teacher_kl"]
        start = f"{curve['mean'][0]:.5f}" if curve["steps"][:1] == [0] else "n/a"
        cells = [s["label"], start, _pm(s["teacher_kl"], 1, 5, s["seeds"] > 1),
                 _pm(s.get("teacher_kl_last3", (math.nan, 0.0)), 1, 5, s["seeds"] > 1)]
        for which in ("teacher_kl", "teacher_kl_last3"):
            seeds, diffs = paired_diffs(s, ref, which) if n != rows[0] else ([], [])
            cells.append(_diff_cell(diffs, scale=1, digits=5))
        cells.append(", ".join(f"s{k} {d:+.5f}" for k, d in zip(seeds, diffs, strict=True)) or "n/a")
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def _diff_cell(diffs: list[float], scale: float = 100.0, digits: int = 1) -> str:
    """Mean difference in points (or times ``scale``), with std and the 95% t-interval over seeds when there
    are several."""
    if not diffs:
        return "n/a"
    mean, std = _mean_std(diffs)
    cell = f"{round(scale * mean, digits) + 0.0:+.{digits}f}"
    if len(diffs) > 1:
        lo, hi = interval95(diffs)
        cell += f" ± {scale * std:.{digits}f} [{scale * lo:+.{digits}f}, {scale * hi:+.{digits}f}]"
    return cell


def _per_seed_cell(seeds: list[str], diffs: list[float]) -> str:
    """Each seed's difference in points: "s0 +1.0, s1 -2.0"."""
    return ", ".join(f"s{k} {100 * d:+.1f}" for k, d in zip(seeds, diffs, strict=True)) or "n/a"


def _anchor_vs_policy(summary: dict[str, Any]) -> list[str]:
    """Which model to ship: each run's anchor against its own policy, seed by seed (final accuracy,
    and the areas under the two curves where the anchor was evaluated along the way)."""
    rows = []
    for s in summary.values():
        seeds, final = anchor_minus_policy(s)
        if not seeds:
            continue
        aucs = [s["per_seed"][k]["anchor_auc"] - s["per_seed"][k]["auc"] for k in seeds
                if s["per_seed"][k].get("anchor_auc") is not None]
        rows.append("| " + " | ".join([s["label"], _diff_cell(final), _per_seed_cell(seeds, final),
                                        _diff_cell(aucs)]) + " |")
    if not rows:
        return []
    return ["Each run's anchor against its own policy (anchor minus policy, same run), in points, "
            "mean ± std [95% interval]:", "",
            "| config | final | final: per seed | AUC (anchor evaluated along the way) |", "|" + "---|" * 4,
            *rows, ""]


def _paired(summary: dict[str, Any], rows: list[str]) -> list[str]:
    """Differences from the first config, seed by seed (the same prompts and samples up to the first
    difference), in points, with 95% t-intervals over seeds: seed-to-seed spread cancels, which
    unpaired mean ± std cannot show. Final policy and anchor accuracy (and each seed's), the policy's
    peak, its drawdown (peak minus final) and its area under the accuracy curve (the mean height)."""
    if len(rows) < 2:
        return []
    ref = summary[rows[0]]
    lines = [f"Paired with {ref['label']} (same seed), differences in points, mean ± std [95% interval]:", "",
             "| config | policy | policy: per seed | anchor | anchor: per seed | peak | drawdown | AUC |",
             "|" + "---|" * 8]
    for n in rows[1:]:
        cells = [summary[n]["label"]]
        for which in ("policy", "anchor", "peak", "drawdown", "auc"):
            seeds, diffs = paired_diffs(summary[n], ref, which)
            cells.append(_diff_cell(diffs))
            if which in ("policy", "anchor"):
                cells.append(_per_seed_cell(seeds, diffs))
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def per_problem_section(spec: Spec, out: Path, summary: dict[str, Any]) -> str:
    """Per group, each config's final policy against the group's first on the same held-out problems,
    seed by seed (exact McNemar: problems only this config solved / only the first solved, p); empty
    where no run kept its outcomes."""
    lines = []
    for group, names in (spec.groups or {"all": list(summary)}).items():
        rows = [n for n in names if n in summary]
        for n in rows[1:]:
            cells = [f"s{seed} +{a}/-{b} (p {p:.2g})" for seed, a, b, p in per_problem(spec, out, n, rows[0])]
            if cells:
                lines.append(f"| {group} | {summary[n]['label']} vs {summary[rows[0]]['label']} | {', '.join(cells)} |")
    if not lines:
        return ""
    return ("\n\nProblem by problem: final policies on the same held-out problems, per seed (exact McNemar: "
            "problems only this config solved / only the reference solved, two-sided p):\n\n"
            "| group | configs | per seed |\n|---|---|---|\n" + "\n".join(lines) + "\n")


PANELS_PER_ROW = 3


def drawn_panels(summary: dict[str, Any], names: list[str]) -> dict[str, str]:
    """The panels with something to show: a curve of two or more points in some config (an empty panel, or a
    single point drawn as a "curve", is left out)."""
    panels = {**CURVES, **TEACHER_CURVES}
    return {t: k for t, k in panels.items()
            if any(len(summary[n]["curves"].get(k, {}).get("steps") or []) >= 2 for n in names)}


def plot(summary: dict[str, Any], path: Path, names: list[str] | None = None) -> Path:
    """One figure: a panel per curve that has one (:func:`drawn_panels`), at most three to a row, a line per
    config (mean over seeds) with a ±1 std band, each axis with its unit; configs whose curves coincide are
    drawn dashed and named "(= ...)" so none hides another (the run plots' :func:`draw_series`)."""
    names = [n for n in (names or list(summary)) if n in summary]
    panels = drawn_panels(summary, names) or dict(list(CURVES.items())[:1])
    cols = min(PANELS_PER_ROW, len(panels))
    rows = -(-len(panels) // cols)
    fig = Figure(figsize=(4.4 * cols, 3.4 * rows))  # (no pyplot: no global figure state, no GUI backend)
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, (title, key) in zip(axes.flat, panels.items(), strict=False):
        unit, scale = METRIC_UNITS.get(key, ("", 1.0))
        drawn: list[tuple[str, list]] = []
        for n in names:
            c = summary[n]["curves"][key]
            if not c["steps"]:
                continue
            lo = [scale * (m - s) for m, s in zip(c["mean"], c["std"], strict=True)]
            hi = [scale * (m + s) for m, s in zip(c["mean"], c["std"], strict=True)]
            line = draw_series(ax, c["steps"], [scale * m for m in c["mean"]], summary[n]["label"], drawn,
                               marker_below=12, ms=3)
            ax.fill_between(c["steps"], lo, hi, color=line.get_color(), alpha=0.15)
        log = key in TEACHER_CURVES.values()
        if log:
            ax.set_yscale("log")  # step 0 is 20-50x the rest
        finish_axes(ax, title, unit + (" (log scale)" if log else ""), fontsize=10)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


VERDICT_COLOURS = {"holds": "tab:green", "fails": "tab:red", "undecided": "tab:gray"}


def plot_claims(judged: list[Judged], path: Path) -> Path:
    """The study's claims, a row each: the mean paired difference with its 95% t-interval (the bar) and each
    seed's difference (the dots), zero marked, coloured by the corrected verdict (green holds, red fails, grey
    undecided) and labelled with it and its Holm p; one panel per unit (points, nats per token). A claim of no
    difference that "holds" only detected none: it is drawn blue and says so."""
    by_unit: dict[str, list[Judged]] = {}
    for j in judged:
        by_unit.setdefault(unit(j.claim.metric)[0], []).append(j)
    heights = [0.62 * len(js) + 0.9 for js in by_unit.values()]
    fig = Figure(figsize=(9.5, sum(heights)))
    axes = fig.subplots(len(by_unit), 1, squeeze=False, gridspec_kw={"height_ratios": heights})
    for ax, (name, js) in zip(axes[:, 0], by_unit.items(), strict=True):
        scale = unit(js[0].claim.metric)[1]
        labels = []
        for row, j in enumerate(js):
            verdict = j.corrected if j.claim.directional or j.corrected != "holds" else "no difference detected"
            colour = VERDICT_COLOURS.get(verdict, "tab:blue")
            ax.scatter([scale * d for d in j.diffs], [row] * len(j.diffs), s=12, color=colour, alpha=0.45)
            if j.interval is not None:
                ax.plot([scale * j.interval[0], scale * j.interval[1]], [row, row], color=colour, lw=2.5)
            if j.mean is not None:
                ax.plot([scale * j.mean], [row], "D", color=colour, ms=6)
            holm = "" if j.holm_t is None else f", Holm p {j.holm_t:.2g}"
            labels.append(textwrap.fill(f"{j.hypothesis}: {j.claim.text}", 48)
                          + f"\n{verdict}{holm} ({j.seeds} seeds)")
        ax.axvline(0, color="black", lw=0.8)
        ax.set_yticks(range(len(js)), labels, fontsize=7)
        ax.set_ylim(len(js) - 0.5, -0.5)  # the spec's order, top to bottom
        ax.set_xlabel(f"paired difference ({name}): mean, 95% t-interval, each seed")
        ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def check_report_files(spec: Spec, out: Path) -> None:
    """Refuse, before any run starts, an ``--out`` where a file the report writes (summary.json, results.md,
    claims.png, a group's figure) is a file the study reads (its spec, its base config): the report would
    write over it (a base config named results.md in --out was lost)."""
    written = ["summary.json", "results.md", "claims.png", *(f"{g}.png" for g in (spec.groups or {"compare": 0}))]
    inputs = {Path(f).resolve(): f for f in (spec.source, spec.base) if f is not None}
    for name in written:
        hit = inputs.get((out / name).resolve())
        if hit is not None:
            raise EmapgError(f"--out {out}: the report writes {out / name}, which is {hit}, a file this study reads; "
                             "pick another --out or move the file (nothing was written)")


def report(spec: Spec, out: Path) -> str:
    """Write summary.json, results.md and one figure per group (or compare.png); return the markdown.
    (:func:`check_report_files` first: ``emapg compare`` runs it before any run starts.)"""
    summary = summarize(spec, out)
    if not summary:  # an empty or mistyped --out: say so, not an empty report that exits 0
        raise EmapgError(f"--out {out}: no run of this spec has finished there (looked for "
                         f"{out / next(iter(spec.configs))}/seed{spec.seeds[0]}/eval.json and the like): nothing to "
                         "report (nothing was written)")
    (out / "summary.json").write_text(json.dumps(_finite(summary), indent=1, allow_nan=False))  # strict JSON
    md = markdown(spec, summary) + per_problem_section(spec, out, summary)
    if spec.source is not None:
        alpha, hypotheses = load_hypotheses(spec.source)
        if hypotheses:
            judged = judge(summary, hypotheses, alpha)
            md += ("\n\n**The spec's hypotheses** (`bench/stability_verdicts.py` prints the same; the figure: "
                   "claims.png)\n\n" + table(judged, hypotheses, len(spec.seeds), alpha) + "\n")
            plot_claims(judged, out / "claims.png")
    (out / "results.md").write_text(md)
    for group, names in (spec.groups or {"compare": list(summary)}).items():
        if any(n in summary for n in names):  # a group none of whose runs has finished gets no empty figure
            plot(summary, out / f"{group}.png", names)
    return md
