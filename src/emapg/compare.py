"""Side-by-side comparisons: several configurations x the same seeds x the same budget.

A comparison spec (YAML) names a base recipe, overrides shared by every run, the seeds, and the
configurations (each a list of overrides); ``quick`` may shrink all of it. Each run is a plain
``emapg train`` in its own process and folder (``OUT/<config>/seed<k>``); a finished run (its
eval.json exists) is not run again, so an interrupted comparison continues where it stopped: an
unfinished run resumes from its checkpoint, or, with none, starts again (its old folder moved to
``seed<k>.stale``). One ``emapg compare`` at a time may run into an output folder (a lock says so).

The summary reads the runs' metrics.jsonl: mean and spread over seeds of held-out accuracy, reward,
KL to the anchor, KL to the initial policy and entropy, as one PNG figure and a markdown table.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from emapg.checkpoint import has_checkpoint
from emapg.config import ConfigError, load_config
from emapg.metrics import read_metrics
from emapg.outcomes import final_outcomes
from emapg.runs import LOCK_ENV, MARKER, claim_run_folder, unlock_run
from emapg.stats import interval95, mcnemar_p
from emapg.verdicts import anchor_minus_policy, judge, load_hypotheses, paired_diffs, table

CURVES = {  # panel title -> metrics key
    "held-out accuracy (policy)": "eval/policy_accuracy",
    "held-out accuracy (anchor)": "eval/anchor_accuracy",
    "reward": "reward_mean",
    "KL to the anchor (to the teacher when distilling)": "kl",
    "KL to the initial policy": "kl_to_init",
    "entropy": "entropy",
}


@dataclass
class Spec:
    base: Path
    overrides: list[str]
    seeds: list[int]
    configs: dict[str, list[str]]
    labels: dict[str, str] = field(default_factory=dict)
    groups: dict[str, list[str]] = field(default_factory=dict)
    prune_checkpoints: bool = False
    source: Path | None = None  # the spec file (its hypotheses, if it declares any)


def load_spec(path: str | Path, quick: bool = False, only: list[str] | None = None) -> Spec:
    """Read a comparison spec; errors name the file and the field."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: malformed YAML ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping with base, configs, seeds")
    for key in ("base", "configs"):
        if key not in raw:
            raise ConfigError(f"{path}: missing field {key!r}")
    if not isinstance(raw["configs"], dict):
        raise ConfigError(f"{path}: configs: expected a mapping of name -> list of KEY=VALUE overrides, got "
                          f"{type(raw['configs']).__name__}")
    configs = {}
    for name, spec in raw["configs"].items():
        over = spec.get("overrides", []) if isinstance(spec, dict) else spec
        if not isinstance(over, list) or not all(isinstance(o, str) and "=" in o for o in over):
            raise ConfigError(f"{path}: configs.{name}: expected a list of KEY=VALUE overrides")
        configs[str(name)] = over
    labels = {str(n): s.get("label", n) for n, s in raw["configs"].items() if isinstance(s, dict)}
    overrides, seeds = list(raw.get("overrides", [])), raw.get("seeds", [0])
    if quick:
        q = raw.get("quick") or {}
        overrides += q.get("overrides", [])
        seeds = q.get("seeds", seeds)
        only = only or q.get("only")
    if only:
        unknown = [n for n in only if n not in configs]
        if unknown:
            raise ConfigError(f"{path}: unknown configs {unknown}; known: {', '.join(configs)}")
        configs = {n: configs[n] for n in only}
    if not isinstance(seeds, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in seeds):
        raise ConfigError(f"{path}: seeds: expected a list of whole numbers, got {seeds!r}")
    base = Path(raw["base"])
    if not base.is_absolute():
        base = (path.parent / base).resolve()
    if not base.exists():
        raise ConfigError(f"{path}: base: {base} does not exist")
    raw_groups = raw.get("groups") or {}
    if not isinstance(raw_groups, dict) or not all(isinstance(v, list) for v in raw_groups.values()):
        raise ConfigError(f"{path}: groups: expected a mapping of group name -> list of config names")
    unknown = sorted({str(n) for names in raw_groups.values() for n in names} - {str(k) for k in raw["configs"]})
    if unknown:
        raise ConfigError(f"{path}: groups: unknown configs {unknown}; known: {', '.join(map(str, raw['configs']))}")
    for name, over in configs.items():  # every config is checked before the first run starts
        try:
            load_config(base, [*overrides, *over])
        except ConfigError as e:
            raise ConfigError(f"{path}: configs.{name}: {e}") from None
    groups = {g: [n for n in names if n in configs] for g, names in raw_groups.items()}
    prune = raw.get("prune_checkpoints", False)
    if not isinstance(prune, bool):
        raise ConfigError(f"{path}: prune_checkpoints: expected true or false, got {prune!r}")
    return Spec(base=base, overrides=overrides, seeds=[int(s) for s in seeds], configs=configs, labels=labels,
                prune_checkpoints=prune, source=path,
                groups={g: names for g, names in groups.items() if names})


def run_all(spec: Spec, out: Path, log=print, jobs: int = 1) -> None:
    """Run every (config, seed) not yet finished, one process each, and record its wall time.

    jobs > 1 runs that many at once, each with threads = CPU cores // jobs (torch's threads; a
    run's numbers can differ in the last bits with the thread count, so compare runs made alike).

    A file named STOP_FILE in `out` (`touch OUT/.compare.stop`) stops it gently: it starts no new run,
    lets the running ones finish (recorded as usual) and returns; the file is removed, so the next
    call carries on. (Ctrl-C instead stops the running runs at once; they resume from their last
    checkpoint on the next call.)
    """
    if jobs < 1:
        raise ConfigError(f"--jobs: must be >= 1, got {jobs}")
    if (out / MARKER).exists():
        raise ConfigError(f"--out {out}: is the folder of a training run (emapg train wrote it); a comparison needs "
                          "a folder of its own (nothing was changed)")
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".compare.lock", "w") as lock:  # a second compare would restart this one's live runs
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"--out {out}: another emapg compare is running into it") from None
        _run_locked(spec, out, log, jobs)


STOP_FILE = ".compare.stop"


def _run_locked(spec: Spec, out: Path, log, jobs: int) -> None:
    stop = out / STOP_FILE
    if stop.exists():  # left from before this call: it was meant for a compare that is no longer running
        stop.unlink()
        log(f"removed {stop}, left from an earlier call")
    total = len(spec.configs) * len(spec.seeds)
    threads = max(1, (os.cpu_count() or 1) // jobs)
    pending: list[tuple[Path, list[str], str]] = []
    done = 0
    for seed in spec.seeds:  # seed-major: a comparison stopped early still has every config at its first seeds
        for name, over in spec.configs.items():
            done += 1
            run = out / name / f"seed{seed}"
            if (run / "eval.json").exists():
                log(f"[{done}/{total}] {name} seed {seed}: done already")
                continue
            cmd = [sys.executable, "-m", "emapg", "train", "--config", str(spec.base), "--out", str(run),
                   *spec.overrides, *over, f"seed={seed}", *([f"threads={threads}"] if jobs > 1 else [])]
            if has_checkpoint(run):
                cmd = [sys.executable, "-m", "emapg", "train", "--resume", str(run)]
            elif run.exists():  # stopped before its first checkpoint: start it again, its leftovers set aside
                stale = run.with_name(run.name + ".stale")  # (the last failure's log stays readable there)
                shutil.rmtree(stale, ignore_errors=True)
                run.rename(stale)
            pending.append((run, cmd, f"[{done}/{total}] {name} seed {seed}: {' '.join(cmd[3:])}"))
    running: list[tuple[Path, subprocess.Popen, float, Any]] = []
    left = 0
    try:
        while pending or running:
            if pending and stop.exists():
                left = len(pending)
                log(f"{stop} found: starting none of the {left} runs left, letting the {len(running)} running finish")
                pending.clear()
            while pending and len(running) < max(1, jobs):
                run, cmd, line = pending.pop(0)
                log(line)
                env = {**os.environ, "HF_HUB_OFFLINE": "1"}
                if "--resume" not in cmd:  # new (a stale one was set aside above): held for the run it starts
                    claim_run_folder(run, has_checkpoint=False)
                    env[LOCK_ENV] = str(run.resolve())
                err = open(run / "compare_stderr.log", "w")  # closed by _finish
                proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
                running.append((run, proc, time.perf_counter(), err))
            time.sleep(0.2)
            for item in [r for r in running if r[1].poll() is not None]:
                running.remove(item)
                _finish(*item)
                if spec.prune_checkpoints:  # finished: its metrics and eval stay, its ~2 GB of checkpoints go
                    shutil.rmtree(item[0] / "checkpoints", ignore_errors=True)
        if stop.exists():
            stop.unlink()  # honoured, or too late to matter: either way the next call carries on
            log(f"stopped by {stop} (removed): {left} runs left for the next call" if left else
                f"removed {stop}: it came after the last run had started")
    finally:
        for run, proc, _, err in running:  # interrupted: stop the runs; their checkpoints let the next call resume
            proc.terminate()
            err.close()
            unlock_run(run)


def _finish(run: Path, proc: subprocess.Popen, t0: float, err) -> None:
    seconds = time.perf_counter() - t0
    err.close()
    unlock_run(run)
    if proc.returncode != 0:
        tail = (run / "compare_stderr.log").read_text()[-3000:]
        raise RuntimeError(f"run {run} failed (exit {proc.returncode}):\n{tail}")
    prev = json.loads((run / "compute.json").read_text())["seconds"] if (run / "compute.json").exists() else 0
    (run / "compute.json").write_text(json.dumps({"seconds": prev + seconds}))


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
    ``transfer_policy_last3``, ...), the mean of the last three evaluations and the last one. The
    anchor's curve counts only where it was evaluated (step 0 excluded: there it is the policy)."""
    out = {}
    for name, key in (("policy", "eval/policy_accuracy"), ("anchor", "eval/anchor_accuracy"),
                      ("transfer_policy", "eval/transfer_policy_accuracy"),
                      ("transfer_anchor", "eval/transfer_anchor_accuracy")):
        curve = _curve(rows, key)
        values = [curve[s] for s in sorted(curve)]
        if len(values) >= SMOOTH:
            out[f"{name}_last{SMOOTH}"] = statistics.fmean(values[-SMOOTH:])
        if name.startswith("transfer") and values:
            out[name] = values[-1]
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


def summarize(spec: Spec, out: Path) -> dict[str, Any]:
    """Per config: mean/std curves over seeds, final numbers, compute. Runs not finished are left out."""
    summary: dict[str, Any] = {}
    for name in spec.configs:
        done = [s for s in spec.seeds if (out / name / f"seed{s}" / "eval.json").exists()]
        runs = [out / name / f"seed{s}" for s in done]
        if not runs:
            continue
        metrics = [read_metrics(r) for r in runs]
        curves = {}
        for key in CURVES.values():
            per_seed = [_anchor_curve(m) if key == "eval/anchor_accuracy" else _curve(m, key) for m in metrics]
            steps = sorted(set.intersection(*(set(c) for c in per_seed))) if per_seed else []
            curves[key] = {"steps": steps,
                           "mean": [_mean_std([c[s] for c in per_seed])[0] for s in steps],
                           "std": [_mean_std([c[s] for c in per_seed])[1] for s in steps]}
        finals = [json.loads((r / "eval.json").read_text()) for r in runs]

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
        compute = [json.loads((r / "compute.json").read_text())["seconds"] for r in runs
                   if (r / "compute.json").exists()]
        ends = [endpoints(m) for m in metrics]
        summary[name] = {
            "label": spec.labels.get(name, name), "seeds": len(runs), "curves": curves,
            "init": _mean_std(accuracies("init")), "policy": _mean_std(accuracies("policy")),
            "anchor": _mean_std(accuracies("anchor")),
            "peak": _mean_std(peak), "drawdown": _mean_std(drawdown), "auc": _mean_std(auc),
            "reward_last5": _mean_std(tail),
            # a sampled estimate with single-step spikes: each run's median over its last 5 steps
            "kl_to_init": _mean_std([statistics.median(v) for m in metrics if (v := _last_steps(m, "kl_to_init"))]),
            "entropy": _mean_std([x["entropy"] for x in last if "entropy" in x]),
            "minutes": _mean_std([c / 60 for c in compute]),
            "per_seed": {str(seed): {**{w: (f.get(w) or {}).get("accuracy") for w in ("policy", "anchor")},
                                     "peak": pk, "drawdown": dd, "auc": a, "anchor_auc": aa, **end}
                         for seed, f, pk, dd, a, aa, end in zip(done, finals, peak, drawdown, auc, anchor_auc, ends,
                                                                strict=True)},
        }
    return summary


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
    lines += _anchor_vs_policy(summary)
    return "\n".join(lines)


def _diff_cell(diffs: list[float]) -> str:
    """Mean difference in points, with std and the 95% t-interval over seeds when there are several."""
    if not diffs:
        return "n/a"
    mean, std = _mean_std(diffs)
    cell = f"{round(100 * mean, 1) + 0.0:+.1f}"
    if len(diffs) > 1:
        lo, hi = interval95(diffs)
        cell += f" ± {100 * std:.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]"
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


def plot(summary: dict[str, Any], path: Path, names: list[str] | None = None) -> Path:
    """One figure: a panel per curve, a line per config (mean over seeds) with a ±1 std band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in (names or list(summary)) if n in summary]
    fig, axes = plt.subplots(1, len(CURVES), figsize=(4.2 * len(CURVES), 3.4))
    for ax, (title, key) in zip(axes, CURVES.items(), strict=True):
        for n in names:
            c = summary[n]["curves"][key]
            if not c["steps"]:
                continue
            lo = [m - s for m, s in zip(c["mean"], c["std"], strict=True)]
            hi = [m + s for m, s in zip(c["mean"], c["std"], strict=True)]
            line, = ax.plot(c["steps"], c["mean"], marker="o" if len(c["steps"]) < 12 else None, ms=3,
                            label=summary[n]["label"])
            ax.fill_between(c["steps"], lo, hi, color=line.get_color(), alpha=0.15)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(spec: Spec, out: Path) -> str:
    """Write summary.json, results.md and one figure per group (or compare.png); return the markdown."""
    summary = summarize(spec, out)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    md = markdown(spec, summary) + per_problem_section(spec, out, summary)
    if spec.source is not None:
        alpha, hypotheses = load_hypotheses(spec.source)
        if hypotheses:
            md += ("\n\n**The spec's hypotheses** (`bench/stability_verdicts.py` prints the same)\n\n"
                   + table(judge(summary, hypotheses, alpha), hypotheses, len(spec.seeds), alpha) + "\n")
    (out / "results.md").write_text(md)
    for group, names in (spec.groups or {"compare": list(summary)}).items():
        if any(n in summary for n in names):  # a group none of whose runs has finished gets no empty figure
            plot(summary, out / f"{group}.png", names)
    return md
