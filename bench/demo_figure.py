"""The README's figure: the demo's held-out accuracy by step, the policy and its EMA anchor, from the published
records (docs/results/demo.json, written by bench/publish_run.py from `bash scripts/demo.sh`): the run of 2026-12-07
and, fainter, the run of 2026-12-05 on another machine: the same code, other CPU kernels, other tokens.

    python bench/demo_figure.py [--out docs/demo.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "demo.png"))
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    results = ROOT / "docs" / "results"
    demo = json.loads((results / "demo.json").read_text())["runs"]
    runs = [("2026-12-07", demo["2026-12-07"], 1.0), ("2026-12-05", demo["2026-12-05"], 0.35)]
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    for day, run, alpha in runs:
        for i, (key, label, style) in enumerate((("policy_by_step", "policy", {}),
                                                 ("anchor_by_step", "EMA anchor (eta 0.9)", {"ls": "--"}))):
            points = {0: run["init"], **{int(s): v for s, v in run[key].items()}}  # step 0: the initial model
            xs = sorted(points)
            ax.plot(xs, [100 * points[x] for x in xs], marker="o", ms=4, color=f"C{i}", alpha=alpha,
                    label=f"{label}, {day}", **style)
    run = runs[0][1]
    ax.axhline(100 * run["init"], color="grey", lw=0.8, ls=":", label="initial model")
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out accuracy (%)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title("SmolLM2-135M, 200 held-out additions (greedy): a run on each of two CPUs", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
