"""Seconds per step of TRL's GRPOTrainer (k3, frozen reference) against EMAPGTrainer (EMA reference,
top-k reverse KL with k = 32), side by side in one run on the same work.

Work per step (as bench/vs_trl.py): SmolLM2-135M-Instruct (fp32, CPU), 8 two-digit-addition prompts
x 4 samples, at most 32 new tokens, temperature 1, beta 0.001, one optimizer step per batch, the
same prompts in the same order for both. The two trainers run alternately (A B A B ...) so that
drift of this shared machine's speed falls on both. Step 1 of each run is a warm-up and is left
out of the medians. What EMAPGTrainer adds per step: the reference's top-k from its pass's hidden
states (one more head product, no grad), the policy's log-probs at 32 ids per position, one EMA
update. Generation, which neither changes, dominates a step; the table also gives the mean
response length, since sampled lengths differ between runs.

    python bench/trl_plugin.py --steps 5 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from vs_trl import BETA, MAX_NEW, PROMPTS, SAMPLES, run_trl, step_examples


def run(cls_name: str, model_dir: str, examples, steps: int, threads: int) -> tuple[list[float], list[float]]:
    """bench/vs_trl.py's TRL run (same config, timer and reward), with either trainer."""
    from emapg.integrations.trl import EMAPGTrainer

    make = None
    if cls_name == "EMAPGTrainer":
        def make(**kw):
            return EMAPGTrainer(**kw, eta=0.9, kl="topk_reverse", k=32)
    return run_trl(model_dir, examples, steps, threads, make=make)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2, help="alternating runs of each trainer")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    from emapg.models.zoo import smollm2_folder
    from emapg.tasks import make_task

    model_dir = str(smollm2_folder())
    examples = step_examples(make_task("arithmetic"), 0, args.steps)
    results: dict[str, dict[str, list[float]]] = {"GRPOTrainer": {"times": [], "lengths": []},
                                                  "EMAPGTrainer": {"times": [], "lengths": []}}
    for r in range(args.rounds):
        for name in results:
            times, lengths = run(name, model_dir, examples, args.steps, args.threads)
            results[name]["times"] += times[1:]  # step 1 is a warm-up
            results[name]["lengths"] += lengths
            print(f"round {r + 1} {name}: {', '.join(f'{t:.1f}' for t in times)} s", flush=True)
    base = statistics.median(results["GRPOTrainer"]["times"])
    print(f"\n{PROMPTS} prompts x {SAMPLES} samples, <= {MAX_NEW} new tokens, beta {BETA}, {args.threads} threads, "
          f"{args.rounds} alternating runs of {args.steps} steps, median over steps 2..{args.steps}\n")
    print("| trainer | s/step (median) | vs GRPOTrainer | mean response tokens | steps timed |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        m = statistics.median(r["times"])
        print(f"| {name} | {m:.2f} | {m / base:.3f}x | {statistics.mean(r['lengths']):.1f} | {len(r['times'])} |")


if __name__ == "__main__":
    main()
