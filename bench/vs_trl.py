"""Seconds per RL step: emapg against TRL's GRPOTrainer on the same work, side by side in one run.

Work per step: SmolLM2-135M-Instruct (fp32, CPU), 8 two-digit-addition prompts x 4 samples, at most
32 new tokens, temperature 1, plain sampling, beta 0.001, one optimizer step per batch. Every side
sees the same prompts in the same order (the emapg task's draws for steps 1..N).

  trl            GRPOTrainer, frozen reference model, k3 KL (TRL's only KL), one micro-batch of 32
  emapg-grpo     emapg, eta = 1 (frozen anchor) and k3: the paper's GRPO baseline
  emapg-ema-topk emapg, eta = 0.9 EMA anchor and top-k reverse KL, k = 32: EMA-PG

Step 1 is a warm-up (allocator, lazy optimizer state) and is left out of the medians.
TRL is a bench-only dependency: pip install -e ".[bench]".

    python bench/vs_trl.py --steps 4
    python bench/vs_trl.py --steps 4 --repeat 3 --out docs/results/vs_trl.json   # what the README quotes

With ``--repeat R`` every side runs R times, one round after another (TRL, then each emapg side); each
round's ratio to TRL compares sides measured minutes apart on the same machine, and the median over rounds
is what the docs quote, with the machine's CPU (the ratio depends on it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch
from _common import commit, machine

PROMPTS, SAMPLES, MAX_NEW, BETA, LR = 8, 4, 32, 0.001, 1e-5


def step_examples(task, seed: int, steps: int):
    """The prompts emapg's trainer draws at steps 1..steps."""
    from emapg.run.trainer import step_seed

    out = []
    for step in range(1, steps + 1):
        out += task.train_examples(random.Random(step_seed(seed, step)), PROMPTS)
    return out


def run_trl(model_dir: str, examples, steps: int, threads: int, make=None) -> tuple[list[float], list[float]]:
    """Seconds of each step and mean response lengths of a TRL trainer on the work; ``make(**kwargs)``
    builds it from GRPOTrainer's arguments (default: GRPOTrainer itself)."""
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from emapg.integrations.trl import task_reward
    from emapg.tasks import make_task

    torch.set_num_threads(threads)

    class StepTimer(TrainerCallback):
        # on_step_begin .. on_step_end brackets training_step, in which GRPOTrainer generates,
        # scores, runs the reference model, and then the loss, backward and optimizer step.
        def __init__(self):
            self.times, self.lengths, self.t0 = [], [], 0.0

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                self.lengths.append(logs["completions/mean_length"])

    ds = Dataset.from_list([{"prompt": ex.messages, "answer": int(ex.answer)} for ex in examples])
    tok = AutoTokenizer.from_pretrained(model_dir)
    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(
            output_dir=out, per_device_train_batch_size=PROMPTS * SAMPLES, gradient_accumulation_steps=1,
            num_generations=SAMPLES, num_iterations=1, max_steps=steps, max_completion_length=MAX_NEW,
            temperature=1.0, top_k=0, top_p=1.0, beta=BETA, learning_rate=LR, lr_scheduler_type="constant",
            gradient_checkpointing=False, activation_checkpointing=False, bf16=False, fp16=False, use_cpu=True,
            model_init_kwargs={"dtype": torch.float32}, shuffle_dataset=False, report_to="none",
            save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0,
        )
        timer = StepTimer()
        trainer = (make or GRPOTrainer)(model=model_dir, reward_funcs=task_reward(make_task("arithmetic")), args=cfg,
                                        train_dataset=ds, processing_class=tok, callbacks=[timer])
        assert trainer.args.generation_batch_size == PROMPTS * SAMPLES and trainer.ref_model is not None
        trainer.train()
    return timer.times, timer.lengths


def run_emapg(steps: int, threads: int, overrides: list[str]) -> tuple[list[dict], float]:
    from emapg.config import load_config
    from emapg.run.trainer import Trainer

    cfg = load_config(None, [
        "model=smollm2-135m", "task=arithmetic", f"steps={steps}", "seed=0", f"prompts_per_step={PROMPTS}",
        f"micro_batch_prompts={PROMPTS}", f"lr={LR}", f"threads={threads}", "eval.size=0", "export=false",
        f"rollout.n={SAMPLES}", f"rollout.max_new_tokens={MAX_NEW}", f"algo.beta={BETA}", *overrides])
    with tempfile.TemporaryDirectory() as out:
        tr = Trainer(cfg, out, progress=False)
        rows = [tr.train_step(s) for s in range(1, steps + 1)]
        t0 = time.perf_counter()
        tr.run.anchor.update(tr.run.model)  # what one EMA update costs on its own
        ema_seconds = time.perf_counter() - t0
    return rows, ema_seconds


VARIANTS = {"emapg-grpo": ["algo.eta=1.0", "algo.kl=k3"],
            "emapg-ema-topk": ["algo.eta=0.9", "algo.ema_every=1", "algo.kl=topk_reverse", "algo.k=32"]}


def one_round(model_dir: str, examples, args) -> dict[str, dict]:
    """Every side once, on the same prompts: each side's step times, lengths and phases."""
    results = {}
    if not args.skip_trl:
        times, lengths = run_trl(model_dir, examples, args.steps, args.threads)
        results["trl"] = {"times": times, "lengths": lengths, "gen": None, "anchor": None, "ema": None}
    for name, ov in VARIANTS.items():
        rows, ema = run_emapg(args.steps, args.threads, ov)
        results[name] = {"times": [r["step_seconds"] for r in rows], "lengths": [r["response_length"] for r in rows],
                         "gen": [r["gen_seconds"] for r in rows], "anchor": [r["anchor_seconds"] for r in rows],
                         "ema": ema}
    return results


def _med(xs):
    """The median over steps 2.. (step 1 is the warm-up)."""
    return statistics.median(xs[1:]) if xs and len(xs) > 1 else float("nan")


def print_round(results: dict[str, dict], args) -> None:
    trl = _med(results["trl"]["times"]) if "trl" in results else None
    print(f"\n{PROMPTS} prompts x {SAMPLES} samples, <= {MAX_NEW} new tokens, beta {BETA}, {args.threads} threads, "
          f"median over steps 2..{args.steps}\n")
    print("| side | s/step (median) | vs TRL | generation s | anchor pass s | mean response tokens | all steps s |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        m = _med(r["times"])
        ratio = f"{m / trl:.2f}x" if trl else ""
        gen = f"{_med(r['gen']):.1f}" if r["gen"] else "-"
        anc = f"{_med(r['anchor']):.1f}" if r["anchor"] else "-"
        lens = f"{statistics.mean(r['lengths']):.1f}" if r["lengths"] else "-"
        print(f"| {name} | {m:.1f} | {ratio} | {gen} | {anc} | {lens} | {', '.join(f'{t:.1f}' for t in r['times'])} |")
    print(f"\nOne EMA update of all 135M parameters (fp32): {results['emapg-ema-topk']['ema']:.3f} s")


def summary(rounds: list[dict[str, dict]], args) -> dict:
    """Every round's per-side medians, their median over rounds, and each emapg side's ratio to TRL round by
    round (the side by side measurement) with its median: what ``--out`` writes and the docs quote."""
    sides = {name: [_med(r[name]["times"]) for r in rounds] for name in rounds[0]}
    out = {"date": dt.date.today().isoformat(), "machine": machine(), "commit": commit(),
           "command": f"python bench/vs_trl.py --steps {args.steps} --repeat {args.repeat}",
           "threads": args.threads, "steps": args.steps, "rounds": len(rounds),
           "s_per_step": {name: {"rounds": [round(x, 2) for x in xs], "median": round(statistics.median(xs), 2)}
                          for name, xs in sides.items()}}
    if "trl" in sides:
        out["vs_trl"] = {}
        for name in VARIANTS:
            ratios = [a / b for a, b in zip(sides[name], sides["trl"], strict=True)]
            out["vs_trl"][name] = {"rounds": [round(x, 3) for x in ratios],
                                   "median": round(statistics.median(ratios), 2),
                                   "min": round(min(ratios), 2), "max": round(max(ratios), 2)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip-trl", action="store_true")
    p.add_argument("--repeat", type=int, default=1, help="rounds of every side, one after the other")
    p.add_argument("--out", help="write the rounds and their medians as JSON (docs/results/vs_trl.json)")
    args = p.parse_args()
    from emapg.models.zoo import smollm2_folder
    from emapg.tasks import make_task

    model_dir = str(smollm2_folder())
    examples = step_examples(make_task("arithmetic"), 0, args.steps)
    rounds = []
    for k in range(args.repeat):
        rounds.append(one_round(model_dir, examples, args))
        print(f"\nround {k + 1} of {args.repeat}")
        print_round(rounds[-1], args)
    result = summary(rounds, args)
    print("\n" + json.dumps({k: result[k] for k in ("s_per_step", "vs_trl") if k in result}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
