"""Seconds per step of the search-agent demo (recipes/search_cpu.yaml), re-reading every turn's
whole context (``rollout.agent_cache=false``) against keeping each episode's key/value cache
across turns (the default), side by side in one run, same seed and steps.

Step 1 is a warm-up and is left out of the medians. No held-out evaluation, no checkpoints.
``--only default`` runs the recipe as it is, with no cache override: with PYTHONPATH pointing at
another checkout's src/ it times that version of emapg on the same work.

    python bench/search_step.py --steps 4
    PYTHONPATH=/path/to/old/src python bench/search_step.py --steps 4 --only default
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "search_cpu.yaml"
VARIANTS = {"re-read": ("re-read every turn", False), "cache": ("cache across turns", True),
            "default": ("the recipe as it is", None)}


def run(steps: int, cache: bool | None, overrides: list[str]) -> list[dict]:
    from emapg.config import load_config
    from emapg.run.trainer import Trainer

    choice = [] if cache is None else [f"rollout.agent_cache={str(cache).lower()}"]
    cfg = load_config(RECIPE, [f"steps={steps}", "eval.size=0", "save_every=0", "export=false", *choice, *overrides])
    with tempfile.TemporaryDirectory() as out:
        tr = Trainer(cfg, out, progress=False)
        return [tr.train_step(s) for s in range(1, steps + 1)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--only", choices=list(VARIANTS), nargs="+", default=["re-read", "cache"])
    p.add_argument("overrides", nargs="*", help="extra config overrides, e.g. threads=2")
    args = p.parse_args()
    results = {VARIANTS[name][0]: run(args.steps, VARIANTS[name][1], args.overrides) for name in args.only}
    med = lambda rows, key: statistics.median(r[key] for r in rows[1:])  # noqa: E731
    base = med(next(iter(results.values())), "step_seconds")
    print(f"\nrecipes/search_cpu.yaml, {args.steps} steps, median over steps 2..{args.steps}\n")
    print("| rollout | s/step (median) | vs the first row | generation s | searches/episode | all steps s |")
    print("|---|---|---|---|---|---|")
    for name, rows in results.items():
        m = med(rows, "step_seconds")
        every = ", ".join(f"{r['step_seconds']:.1f}" for r in rows)
        print(f"| {name} | {m:.1f} | {base / m:.2f}x | {med(rows, 'gen_seconds'):.1f} "
              f"| {statistics.mean(r['searches_mean'] for r in rows):.2f} | {every} |")


if __name__ == "__main__":
    main()
