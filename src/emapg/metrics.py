"""Where metrics go: metrics.jsonl (one object per step), TensorBoard, PNG plots, a progress bar."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from emapg.atomic import write_text_atomic

PLOTS = {
    "reward": ["reward_mean"],
    "accuracy": ["eval/policy_accuracy", "eval/anchor_accuracy"],
    "kl": ["kl", "kl_to_init"],
    "entropy": ["entropy"],
}


class MetricsWriter:
    """Appends one JSON object per step to ``metrics.jsonl`` and mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: Path, resume_step: int | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            # Drop rows past the checkpoint we resume from: those steps are re-run.
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            write_text_atomic(self.path, "".join(line + "\n" for line in kept))  # a kill keeps the old file
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"), purge_step=resume_step)

    def write(self, row: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, int | float) and math.isfinite(value):
                    self.tb.add_scalar(key, value, row["step"])
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_run(run_dir: Path) -> list[Path]:
    """PNG plots of reward, held-out accuracy, KL and entropy against step. Returns the files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    out = []
    for name, keys in PLOTS.items():
        fig, ax = plt.subplots(figsize=(5, 3.2))
        drawn = False
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o" if len(pts) < 30 else None, ms=3, label=key)
                drawn = True
        if drawn:
            ax.set_xlabel("step")
            ax.set_title(name)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            fig.tight_layout()
            path = Path(run_dir) / f"{name}.png"
            fig.savefig(path, dpi=100)
            out.append(path)
        plt.close(fig)
    return out


def write_eval_table(run_dir: Path, table: dict[str, dict[str, Any] | None]) -> str:
    """Write eval.json and eval.md (initial model, policy, anchor); return the markdown."""
    Path(run_dir, "eval.json").write_text(json.dumps(table, indent=1))
    lines = ["| model | held-out accuracy |", "|---|---|"]
    for name, res in table.items():
        acc = None if not res else res.get("accuracy")
        lines.append(f"| {name} | {'n/a' if acc is None else f'{100 * acc:.1f}%'} |")
    md = "\n".join(lines) + "\n"
    Path(run_dir, "eval.md").write_text(md)
    return md


def eval_markdown(model: str, rows: list[dict[str, Any]]) -> str:
    """One table for an eval run: a row per dataset (avg@n, pass@k, length) and their average."""
    ks = sorted({k for r in rows for k in r if k.startswith("pass@")}, key=lambda k: int(k[5:]))
    extra = sorted({k for r in rows for k in r if k.endswith("_mean")})  # rollout diagnostics, e.g. searches
    head = ["dataset", "problems", "samples", "avg@n"] + ks + ["mean tokens"] + [k[: -len("_mean")] for k in extra]
    lines = [f"model: {model}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["dataset"], str(r["num"] // max(r.get("samples", 1), 1)), str(r.get("samples", 1)),
                 f"{100 * r['accuracy']:.1f}"] + [f"{100 * r[k]:.1f}" for k in ks] + [f"{r['mean_length']:.0f}"]
        cells += [f"{r[k]:.2f}" if k in r else "" for k in extra]
        lines.append("| " + " | ".join(cells) + " |")
    if len(rows) > 1:
        avg = sum(r["accuracy"] for r in rows) / len(rows)
        lines.append(f"| average | | | {100 * avg:.1f} |" + " |" * (len(ks) + 1 + len(extra)))
    return "\n".join(lines) + "\n"
