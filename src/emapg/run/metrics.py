"""Where metrics go: metrics.jsonl (one object per step), TensorBoard, PNG plots, a progress bar."""

from __future__ import annotations

import json
import math
import sys
import uuid
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from torch.utils.tensorboard import SummaryWriter

from emapg.atomic import append_line, naming_failed_writes, write_json_atomic, write_text_atomic
from emapg.errors import ConfigError, EmapgError, regular_file
from emapg.run.outcomes import anchor_against_policy

PLOTS = {
    "reward": ["reward_mean"],
    "accuracy": ["eval/policy_accuracy", "eval/anchor_accuracy", "eval/ema_accuracy"],
    "kl": ["kl", "kl_to_init"],
    "entropy": ["entropy"],
}
PLOT_TITLES = {
    "reward": "mean reward of the step's responses",
    "accuracy": "held-out accuracy",
    "kl": "KL to the anchor, per token (an estimate: a step's value may be < 0)",
    "entropy": "policy entropy, per token",
}
# each metric's unit on a plot's axis, and the factor its values are shown at (accuracy in %)
METRIC_UNITS = {"reward_mean": ("reward", 1.0), "eval/policy_accuracy": ("accuracy (%)", 100.0),
                "eval/anchor_accuracy": ("accuracy (%)", 100.0),
                "eval/ema_accuracy": ("accuracy (%)", 100.0), "kl": ("nats per token", 1.0),
                "kl_to_init": ("nats per token", 1.0), "entropy": ("nats per token", 1.0),
                "eval/policy_teacher_kl": ("nats per token", 1.0)}
LABELS = {"reward_mean": "reward", "eval/policy_accuracy": "policy", "eval/anchor_accuracy": "EMA anchor",
          "eval/ema_accuracy": "weight EMA",
          "kl": "KL to the anchor", "kl_to_init": "KL to the initial policy", "entropy": "entropy"}


class MetricsWriter:
    """Appends one JSON object per step to ``metrics.jsonl`` and mirrors the scalars to TensorBoard and
    W&B (``report_to``). ``config``: the run's configuration, recorded by W&B."""

    def __init__(self, run_dir: Path, resume_step: int | None = None, report_to: tuple[str, ...] = ("tensorboard",),
                 config: dict[str, Any] | None = None, wandb_project: str = "emapg"):
        self.path = Path(run_dir) / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            # Drop rows past the checkpoint we resume from: those steps are re-run.
            kept = [line for line, row in metrics_lines(self.path) if row["step"] <= resume_step]
            write_text_atomic(self.path, "".join(line + "\n" for line in kept))  # a kill keeps the old file
        self.tb = self.wandb = None
        if "tensorboard" in report_to:

            self.tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"), purge_step=resume_step)
        if "wandb" in report_to:
            self.wandb = _wandb_run(Path(run_dir), config or {}, wandb_project)

    def write(self, row: dict[str, Any]) -> None:
        append_line(self.path, json.dumps(row))
        scalars = {k: v for k, v in row.items()
                   if k != "step" and isinstance(v, int | float) and math.isfinite(v)}
        if self.tb is not None:
            with naming_failed_writes(Path(self.tb.log_dir)):  # its writer thread's full disk, raised here
                for key, value in scalars.items():
                    self.tb.add_scalar(key, value, row["step"])
                self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=row["step"])

    def write_table(self, table: dict[str, dict[str, Any] | None]) -> None:
        """The final eval table (initial model, policy, anchor), as a W&B table and run summary."""
        if self.wandb is None:
            return
        import wandb  # (optional: report_to wandb)

        rows = [[name, None if not res else res.get("accuracy")] for name, res in table.items()]
        self.wandb.log({"eval/table": wandb.Table(columns=["model", "held-out accuracy"], data=rows)})
        self.wandb.summary.update({f"final/{name}_accuracy": acc for name, acc in rows if acc is not None})

    def finish(self, initial_eval: dict[str, Any] | None) -> dict[str, Any]:
        """The run's end: its eval table (:func:`final_table`) written and logged, the plots drawn, the
        writers closed. Returns the table."""
        table = final_table(self.path.parent, initial_eval)
        self.write_table(table)
        self.close()
        plot_run(self.path.parent)
        return table

    def close(self) -> None:
        if self.tb is not None:
            with naming_failed_writes(Path(self.tb.log_dir)):
                self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _wandb_run(run_dir: Path, config: dict[str, Any], project: str):
    """A W&B run for this run folder; a resumed run continues the same W&B run (its id is kept in
    the folder)."""
    try:
        import wandb  # (optional: report_to wandb)
    except ImportError:

        raise ConfigError("report_to: wandb needs Weights & Biases: pip install -e '.[wandb]' in emapg's clone "
                          "(or pip install wandb)") from None
    id_file = run_dir / "wandb_id"
    run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
    write_text_atomic(id_file, run_id + "\n")
    return wandb.init(project=project, id=run_id, name=run_dir.name, dir=str(run_dir), config=config,
                      resume="allow")


class MetricsError(EmapgError, ValueError):
    """A metrics.jsonl that is not what a run writes (named with its line)."""


def metrics_lines(path: Path, warn: bool = True) -> list[tuple[str, dict[str, Any]]]:
    """The rows of a metrics.jsonl with their text, each a JSON object with a whole ``step`` >= 0; anything else
    is a MetricsError naming the file and the line. A last line cut short (a kill while it was written: no
    newline at its end) is dropped with a warning: its step is re-run on resume."""
    regular_file(path, "metrics")  # a FIFO or a device would be read for ever
    raw = Path(path).read_bytes()
    chunks = raw.split(b"\n")
    out = []
    for i, chunk in enumerate(chunks, 1):
        try:  # a stray byte is named, never rewritten as U+FFFD on resume
            line = chunk.decode("utf-8")
        except UnicodeDecodeError as e:
            if i == len(chunks) and not raw.endswith(b"\n"):  # a last line cut inside a character: dropped below
                line = chunk.decode("utf-8", errors="replace")
            else:
                raise MetricsError(f"{path}, line {i}: not UTF-8 text (byte {chunk[e.start]:#04x}); remove the line "
                                   "or restore the file (nothing was rewritten)") from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            if i == len(chunks) and not raw.endswith(b"\n"):  # the last line, unfinished
                if warn:
                    print(f"emapg: warning: {path}, line {i}: cut short (a write was interrupted); dropped",
                          file=sys.stderr)
                break
            raise MetricsError(f"{path}, line {i}: not JSON ({e})") from None
        step = row.get("step") if isinstance(row, dict) else None
        if not isinstance(row, dict) or not isinstance(step, int) or isinstance(step, bool) or step < 0:
            what = f"step {step!r}" if isinstance(row, dict) else f"a JSON {type(row).__name__}"
            raise MetricsError(f"{path}, line {i}: not a metrics row ({what}; each line is an object with a "
                               "whole step >= 0)")
        out.append((line, row))
    return out


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """A run folder's metrics rows, checked (:func:`metrics_lines`)."""
    return [row for _, row in metrics_lines(Path(run_dir) / "metrics.jsonl")]


def plot_run(run_dir: Path) -> list[Path]:
    """PNG plots of reward, held-out accuracy (%), KL and entropy against step (:func:`run_figure`). Returns the
    files."""
    rows = read_metrics(run_dir)
    out = []
    for name in PLOTS:
        fig = run_figure(rows, name)
        if fig is not None:
            path = Path(run_dir) / f"{name}.png"
            fig.savefig(path, dpi=100)
            out.append(path)
    return out


def run_figure(rows: list[dict[str, Any]], name: str):
    """One of :data:`PLOTS` as a matplotlib figure (None when no row has its values): the axis labelled with its
    unit, steps as whole numbers, coinciding series told apart (:func:`draw_series`)."""
    fig = Figure(figsize=(5, 3.2))  # (no pyplot: no global figure state, no GUI backend)
    ax = fig.subplots()
    drawn: list[tuple[str, list]] = []
    for key in PLOTS[name]:
        scale = METRIC_UNITS[key][1]
        pts = [(r["step"], scale * r[key]) for r in rows
               if isinstance(r.get(key), int | float) and math.isfinite(r[key])]
        if pts:
            draw_series(ax, *zip(*pts, strict=True), LABELS.get(key, key), drawn, marker_below=30, ms=4)
    if not drawn:
        return None
    finish_axes(ax, PLOT_TITLES[name], METRIC_UNITS[PLOTS[name][0]][0], fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def draw_series(ax, steps, values, label: str, drawn: list[tuple[str, list]], *, marker_below: int, ms: float):
    """A series on ``ax``; one equal to a series drawn before it (``drawn``: (label, points), appended to) is
    drawn dashed with hollow markers and named "(= that one)", so it does not vanish behind it. The line."""
    points = [list(steps), list(values)]
    same = next((other for other, prev in drawn if prev == points), None)
    style = dict(ls="--", mfc="none") if same else {}
    line, = ax.plot(steps, values, marker="o" if len(steps) < marker_below else None, ms=ms,
                    label=label + (f" (= {same})" if same else ""), **style)
    drawn.append((label, points))
    return line


def finish_axes(ax, title: str, unit: str, fontsize: float) -> None:
    """A plot's axes: its title, step as a whole number on x, the unit on y, a light grid."""
    ax.set_xlabel("step")
    ax.set_ylabel(unit)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(title, fontsize=fontsize)
    ax.grid(alpha=0.3)


def write_eval_table(run_dir: Path, table: dict[str, dict[str, Any] | None], note: str | None = None) -> str:
    """Write eval.json and eval.md (initial model, policy, anchor; ``note`` below the table in eval.md);
    return the markdown."""
    write_json_atomic(Path(run_dir, "eval.json"), table)
    lines = ["| model | held-out accuracy |", "|---|---|"]
    for name, res in table.items():
        acc = None if not res else res.get("accuracy")
        lines.append(f"| {name} | {'n/a' if acc is None else f'{100 * acc:.1f}%'} |")
    if note:
        lines += ["", note]
    md = "\n".join(lines) + "\n"
    write_text_atomic(Path(run_dir, "eval.md"), md)
    return md


def final_table(run_dir: Path, initial_eval: dict[str, Any] | None) -> dict[str, Any]:
    """The run's eval table, {'init', 'policy', 'anchor'} and 'ema' with a weight EMA: the step-0 evaluation and
    the last evaluations metrics.jsonl holds; written as eval.json and eval.md, with the paired tests of the
    anchor and of a weight EMA of its own against the policy on the same problems below the table where the run
    kept their outcomes."""
    last = {}
    for row in read_metrics(run_dir):
        last.update({k: v for k, v in row.items() if k.startswith("eval/")})
    init = None if initial_eval is None else {k: v for k, v in initial_eval.items() if k != "solved"}
    table = {"init": init,
             "policy": {"accuracy": last.get("eval/policy_accuracy")},
             "anchor": {"accuracy": last.get("eval/anchor_accuracy")}}
    if "eval/ema_accuracy" in last:  # weight_ema: the EMA kept for shipping (with EMA-PG, the anchor)
        table["ema"] = {"accuracy": last["eval/ema_accuracy"]}
    notes = [n for n in (anchor_against_policy(run_dir), anchor_against_policy(run_dir, model="ema")) if n]
    write_eval_table(run_dir, table, "\n\n".join(notes) or None)
    return table
