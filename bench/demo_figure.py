"""The README's figure: the demo's held-out accuracy by step, the policy and its EMA anchor, from the published
record (docs/results/demo.json, written by bench/publish_run.py from a run of `bash scripts/demo.sh`).

    python bench/demo_figure.py [--run 2026-12-05] [--out docs/demo.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", default="2026-12-05", help="the run of docs/results/demo.json to draw")
    ap.add_argument("--out", default=str(ROOT / "docs" / "demo.png"))
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    run = json.loads((ROOT / "docs" / "results" / "demo.json").read_text())["runs"][args.run]
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    for key, label, style in (("policy_by_step", "policy", {}), ("anchor_by_step", "EMA anchor (eta 0.9)",
                                                                 {"ls": "--"})):
        points = {0: run["init"], **{int(s): v for s, v in run[key].items()}}  # step 0: the initial model
        xs = sorted(points)
        ax.plot(xs, [100 * points[x] for x in xs], marker="o", ms=4, label=label, **style)
    ax.axhline(100 * run["init"], color="grey", lw=0.8, ls=":", label="initial model")
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out accuracy (%)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title("SmolLM2-135M on 200 held-out two-digit additions (greedy), one run", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
