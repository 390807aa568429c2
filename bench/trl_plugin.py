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
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch
from vs_trl import BETA, LR, MAX_NEW, PROMPTS, SAMPLES, arithmetic_reward, step_examples


def run(cls_name: str, model_dir: str, examples, steps: int, threads: int) -> tuple[list[float], list[float]]:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from emapg.integrations.trl import EMAPGTrainer

    torch.set_num_threads(threads)

    class StepTimer(TrainerCallback):  # training_step: generate, score, reference pass, loss, backward, step
        def __init__(self):
            self.times, self.lengths, self.t0 = [], [], 0.0

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):  # EMAPGTrainer's EMA update ran just before
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
        kw = dict(model=model_dir, reward_funcs=arithmetic_reward, args=cfg, train_dataset=ds, processing_class=tok,
                  callbacks=[timer])
        trainer = (EMAPGTrainer(**kw, eta=0.9, kl="topk_reverse", k=32) if cls_name == "EMAPGTrainer"
                   else GRPOTrainer(**kw))
        trainer.train()
    return timer.times, timer.lengths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2, help="alternating runs of each trainer")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    from emapg.models import smollm2_folder
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
