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
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch

PROMPTS, SAMPLES, MAX_NEW, BETA, LR = 8, 4, 32, 0.001, 1e-5


def step_examples(task, seed: int, steps: int):
    """The prompts emapg's trainer draws at steps 1..steps."""
    from emapg.trainer import step_seed

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
    from emapg.trainer import Trainer

    cfg = load_config(None, [
        "model=smollm2-135m", "task=arithmetic", f"steps={steps}", "seed=0", f"prompts_per_step={PROMPTS}",
        f"micro_batch_prompts={PROMPTS}", f"lr={LR}", f"threads={threads}", "eval.size=0", "export=false",
        f"rollout.n={SAMPLES}", f"rollout.max_new_tokens={MAX_NEW}", f"algo.beta={BETA}", *overrides])
    with tempfile.TemporaryDirectory() as out:
        tr = Trainer(cfg, out, progress=False)
        rows = [tr.train_step(s) for s in range(1, steps + 1)]
        t0 = time.perf_counter()
        tr.anchor.update(tr.model)  # what one EMA update costs on its own
        ema_seconds = time.perf_counter() - t0
    return rows, ema_seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip-trl", action="store_true")
    args = p.parse_args()
    from emapg.models import smollm2_folder
    from emapg.tasks import make_task

    model_dir = str(smollm2_folder())
    examples = step_examples(make_task("arithmetic"), 0, args.steps)
    results = {}
    if not args.skip_trl:
        times, lengths = run_trl(model_dir, examples, args.steps, args.threads)
        results["trl"] = {"times": times, "lengths": lengths, "gen": None, "anchor": None, "ema": None}
    variants = {"emapg-grpo": ["algo.eta=1.0", "algo.kl=k3"],
                "emapg-ema-topk": ["algo.eta=0.9", "algo.ema_every=1", "algo.kl=topk_reverse", "algo.k=32"]}
    for name, ov in variants.items():
        rows, ema = run_emapg(args.steps, args.threads, ov)
        results[name] = {"times": [r["step_seconds"] for r in rows], "lengths": [r["response_length"] for r in rows],
                         "gen": [r["gen_seconds"] for r in rows], "anchor": [r["anchor_seconds"] for r in rows],
                         "ema": ema}
    med = lambda xs: statistics.median(xs[1:]) if xs and len(xs) > 1 else float("nan")  # noqa: E731
    trl = med(results["trl"]["times"]) if "trl" in results else None
    print(f"\n{PROMPTS} prompts x {SAMPLES} samples, <= {MAX_NEW} new tokens, beta {BETA}, {args.threads} threads, "
          f"median over steps 2..{args.steps}\n")
    print("| side | s/step (median) | vs TRL | generation s | anchor pass s | mean response tokens | all steps s |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        m = med(r["times"])
        ratio = f"{m / trl:.2f}x" if trl else ""
        gen = f"{med(r['gen']):.1f}" if r["gen"] else "-"
        anc = f"{med(r['anchor']):.1f}" if r["anchor"] else "-"
        lens = f"{statistics.mean(r['lengths']):.1f}" if r["lengths"] else "-"
        print(f"| {name} | {m:.1f} | {ratio} | {gen} | {anc} | {lens} | {', '.join(f'{t:.1f}' for t in r['times'])} |")
    ema = results["emapg-ema-topk"]["ema"]
    print(f"\nOne EMA update of all 135M parameters (fp32): {ema:.3f} s")


if __name__ == "__main__":
    main()
