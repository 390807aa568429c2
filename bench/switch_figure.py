"""The figure of studies/switch a user reads in ten seconds: the test accuracy of the model each run would ship
(its policy or its weight EMA, chosen on the validation set), per algorithm and learning rate, each seed a dot,
the mean with its 95% t-interval, the initial model as a line.

    python bench/study_records.py restore studies/switch/records runs/switch
    python bench/switch_figure.py --study studies/switch --out runs/switch --png docs/switch.png

A hollow dot is a run that shipped its policy, a filled one its weight EMA.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from emapg.lab.report import summarize
from emapg.lab.study import load_spec
from emapg.stats import interval95

ARMS = (("grpo-b05", "GRPO\nbeta 0.05\n+ weight EMA"), ("grpo-b001", "GRPO\nbeta 0.001\n+ weight EMA"),
        ("emapg", "EMA-PG\neta 0.9, top-k 32\nbeta 0.05"))
LRS = ("5e-5", "3e-5")


def draw(summary: dict, png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(LRS), figsize=(9, 4.2), sharey=True)
    init = [v for s in summary.values() for v in [s["init"][0]] if v == v]
    for ax, lr in zip(axes, LRS, strict=True):
        for x, (arm, _label) in enumerate(ARMS):
            run = summary.get(f"{arm}-{lr}")
            if run is None:
                continue
            seeds = [v for v in run["per_seed"].values() if v.get("shipped") is not None]
            ys = [100 * v["shipped"] for v in seeds]
            for j, (v, y) in enumerate(zip(seeds, ys, strict=True)):
                dx = (j - (len(ys) - 1) / 2) * 0.04
                ax.plot(x + dx, y, "o", ms=6, color=f"C{x}", mfc=f"C{x}" if v.get("shipped_is_ema") else "none")
            if len(ys) >= 2:
                (lo, hi), mean = interval95(ys), statistics.fmean(ys)
                ax.errorbar(x + 0.3, mean, yerr=[[mean - lo], [hi - mean]], fmt="s", color="black", capsize=5, ms=6)
        if init:
            ax.axhline(100 * statistics.fmean(init), color="grey", ls="--", lw=1)
            ax.text(2.45, 100 * statistics.fmean(init) + 0.8, "initial model", color="grey", fontsize=9, ha="right")
        ax.set_xticks(range(len(ARMS)), [label for _, label in ARMS], fontsize=9)
        ax.set_xlim(-0.5, 2.6)
        ax.set_title(f"lr {lr}", fontsize=11)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("test accuracy of the shipped model (%)", fontsize=10)
    fig.suptitle("Which model to ship: each seed a dot (filled: its weight EMA shipped; hollow: its policy),\n"
                 "black: mean and 95% interval; 500 held-out two-digit additions, SmolLM2-135M, 40 steps",
                 fontsize=10)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--study", type=Path, default=Path("studies/switch"))
    p.add_argument("--out", type=Path, required=True, help="the study's runs (emapg compare --out)")
    p.add_argument("--png", type=Path, default=Path("docs/switch.png"))
    args = p.parse_args()
    print(draw(summarize(load_spec(args.study / "spec.yaml"), args.out), args.png))


if __name__ == "__main__":
    main()
