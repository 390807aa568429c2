"""The memory plan (``emapg plan``) against the measured peak of real training runs on this CPU, side by side.

Each shape is a random Qwen2-shaped model saved as a folder (config.json, weights, the byte tokenizer),
trained for 2 steps on the arithmetic task (random models never end a row: every row runs its budget)
in its own process. Measured: the process's peak resident memory (VmHWM, reset once the run is built, so
loading the weights does not count) above its resident memory before the run was built (Python, torch and
the libraries). Predicted: the plan's peak for the same config on one CPU device, the longest prompt of the
task's rows as its prompt length. glibc's malloc returns every block over 64 KiB to the system at once
(MALLOC_MMAP_THRESHOLD_=65536), so resident memory follows what is alive.

    python bench/memory_plan.py
    python bench/memory_plan.py --shapes small long --json rows.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# name: (hidden, layers, intermediate, heads, kv heads, vocab, overrides)
SHAPES = {
    "small": (256, 4, 768, 4, 2, 32000, ["rollout.max_new_tokens=64", "micro_batch_prompts=2"]),
    "wide": (768, 4, 2304, 12, 4, 32000, ["rollout.max_new_tokens=128", "micro_batch_prompts=2"]),
    "deep": (384, 16, 1152, 6, 2, 32000, ["rollout.max_new_tokens=96", "micro_batch_prompts=2"]),
    "long": (384, 6, 1152, 6, 2, 32000, ["rollout.max_new_tokens=512", "micro_batch_prompts=1"]),
    "vocab": (384, 4, 1152, 6, 2, 151936, ["rollout.max_new_tokens=128", "micro_batch_prompts=2"]),
    "rows": (384, 6, 1152, 6, 6, 32000, ["prompts_per_step=16", "rollout.n=8", "rollout.max_new_tokens=128",
                                         "micro_batch_prompts=1", "rollout.max_rows=32"]),
    "checkpointed": (768, 8, 2304, 12, 4, 32000, ["rollout.max_new_tokens=256", "micro_batch_prompts=2",
                                                  "gradient_checkpointing=true"]),
    "bf16": (768, 4, 2304, 12, 4, 32000, ["rollout.max_new_tokens=128", "micro_batch_prompts=2",
                                          "mixed_precision=bf16"]),
}
BASE = ["task=arithmetic", "steps=2", "prompts_per_step=4", "rollout.n=4", "eval.size=0", "export=false",
        "save_every=100", "algo.kl=topk_reverse", "algo.k=32", "algo.eta=0.9", "threads=2", "seed=0"]


def make_folder(name: str, root: Path) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from emapg.models.zoo import byte_tokenizer

    hidden, layers, inter, heads, kv, vocab, _ = SHAPES[name]
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=inter,
        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=1, pad_token_id=1))
    path = root / name
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def measure(folder: str, overrides: list[str]) -> dict:
    """Run 2 steps; the peak above the level before the run was built, and the plan's prediction."""
    import torch

    from emapg.config import load_config
    from emapg.models import plan as P
    from emapg.rollout.prompts import longest_prompt
    from emapg.run.trainer import Trainer

    torch.set_num_threads(2)
    cfg = load_config(None, [f"model={folder}", *BASE, *overrides])
    config = P.model_config(folder)
    P.shape_of(config)  # transformers' model classes imported before the base level, as the run's libraries are
    base_kb = status_kb("VmRSS")
    with tempfile.TemporaryDirectory() as run:
        tr = Trainer(cfg, Path(run), progress=False)
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: loading the weights is not counted
        tr.train()
        peak_kb = status_kb("VmHWM")
        p = P.run_plan(cfg, config, tr.task, tr.tokenizer, device="cpu")  # as emapg train's check
        prompt = longest_prompt(tr.task, tr.tokenizer)  # the prompt length it planned for, for the record
        params = sum(t.numel() for t in tr.model.parameters())
    return {"measured_mb": (peak_kb - base_kb) / 1024, "planned_mb": p.peak / 2**20, "peak_phase": p.peak_phase,
            "params": params, "prompt_tokens": prompt}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        folder, name = args.one
        print(json.dumps(measure(folder, SHAPES[name][6])))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "2"}
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for name in args.shapes:
            folder = make_folder(name, Path(root))
            out = subprocess.run([sys.executable, __file__, "--one", str(folder), name], capture_output=True,
                                 text=True, env=env)
            if out.returncode != 0:
                sys.exit(f"{name}: {out.stderr.strip().splitlines()[-1]}")
            r = {"shape": name, **json.loads(out.stdout.strip().splitlines()[-1])}
            rows.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print("\n| shape | model | settings | planned MB | measured MB | planned / measured | peak phase |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        hidden, layers, inter, heads, kv, vocab, over = SHAPES[r["shape"]]
        model = f"{r['params'] / 1e6:.0f}M: h{hidden} x{layers} i{inter} kv{kv} V{vocab}"
        print(f"| {r['shape']} | {model} | {' '.join(over)} | {r['planned_mb']:.0f} | {r['measured_mb']:.0f} | "
              f"{r['planned_mb'] / r['measured_mb']:.2f} | {r['peak_phase']} |")


if __name__ == "__main__":
    main()
