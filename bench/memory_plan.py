"""The memory plan (``emapg plan``) against the measured peaks of real training runs on this CPU, phase by phase.

Each shape is a random model saved as a folder (config.json, weights, the byte tokenizer; Qwen2, or Llama with
an untied head), trained for 2 steps (the arithmetic task unless its settings say otherwise: random models never
end a row, so every row runs its budget) in its own process, or in two under torchrun (the larger rank's peak).
A short warm-up run of the same config in the same process comes first, so what any run loads once (code, lazy
imports, the tokenizer, the allocator's arenas) sits below the base level. Measured: each phase's peak resident
memory (VmHWM, reset as the trainer enters rollout, anchor_pass, _optimizer_step, _evaluate) above the resident
memory before the run was built. Planned: the plan of the same config for one of its processes on the CPU, at
the longest prompt and response the run made (and, as ``checked_mb``, at the lengths `emapg train`'s check
uses). glibc's malloc returns every block over 64 KiB to the system at once (MALLOC_MMAP_THRESHOLD_=65536), so
resident memory follows what is alive. FITTED holds the shapes the plan's terms were developed against,
HELD_APART the others; ``summary`` in the JSON ranges over the held-apart ones.

    python bench/memory_plan.py --json docs/results/memory_plan.json
    python bench/memory_plan.py --shapes small lora --json rows.json
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

# name: (hidden, layers, intermediate, heads, kv heads, vocab, overrides[, options]); options: processes
# (torchrun), family (qwen2 or llama, untied head), teacher (a second model's widths, for distillation)
FITTED = {  # the shapes the plan's terms were developed against (2026-12-05)
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
SEARCH = ("task_args={synthetic: {seed: 0, people: 20, cities: 6, countries: 3, books: 10}, template: fewshot, "
          "max_turn_tokens: 48, max_total_tokens: 320, max_turns: 3}")
HELD_APART = {  # shapes the terms never saw (issue 54): held apart, each within 15% or the plan is wrong
    "unshared": (768, 4, 2304, 12, 4, 32000, ["rollout.max_new_tokens=128", "micro_batch_prompts=2",
                                              "prefix_sharing=false"]),
    "lora": (768, 4, 2304, 12, 4, 32000, ["rollout.max_new_tokens=128", "micro_batch_prompts=2", "lora.r=16"]),
    "lora-checkpointed": (384, 16, 1152, 6, 2, 32000, ["rollout.max_new_tokens=256", "micro_batch_prompts=2",
                                                       "lora.r=8", "gradient_checkpointing=true"]),
    "teacher-eval": (384, 4, 1152, 6, 2, 32000, ["rollout.max_new_tokens=64", "micro_batch_prompts=2",
                                                 "algo.pg_coef=0", "algo.kl=topk_reverse", "eval.size=64",
                                                 "eval.every=1", "eval.max_new_tokens=128"],
                     {"teacher": (768, 6, 2304, 12, 4, 32000)}),
    "search": (384, 6, 1152, 6, 2, 32000, ["task=search_qa", SEARCH, "rollout.max_new_tokens=48",
                                           "micro_batch_prompts=2"]),
    "eval-samples": (256, 4, 768, 4, 2, 32000, ["rollout.max_new_tokens=32", "micro_batch_prompts=1",
                                                "eval.size=64", "eval.every=1", "eval.greedy=false",
                                                "eval.samples=8", "eval.max_new_tokens=256"]),
    "one-kv-head": (512, 6, 1536, 8, 1, 32000, ["rollout.n=8", "rollout.max_new_tokens=192",
                                                "micro_batch_prompts=1"]),
    "vocab-checkpointed": (384, 4, 1152, 6, 2, 151936, ["rollout.max_new_tokens=256", "micro_batch_prompts=2",
                                                        "gradient_checkpointing=true"]),
    "long-bf16-checkpointed": (512, 8, 1536, 8, 2, 32000, ["rollout.max_new_tokens=512", "micro_batch_prompts=1",
                                                           "gradient_checkpointing=true", "mixed_precision=bf16"]),
    "llama": (512, 6, 1536, 8, 8, 32000, ["rollout.max_new_tokens=128", "micro_batch_prompts=2"],
              {"family": "llama"}),
    "fsdp-bf16": (768, 4, 2304, 12, 4, 32000, ["rollout.max_new_tokens=128", "micro_batch_prompts=2",
                                               "mixed_precision=bf16"], {"processes": 2}),
    "fsdp-fp32-deep": (384, 16, 1152, 6, 2, 32000, ["rollout.max_new_tokens=96", "micro_batch_prompts=2"],
                       {"processes": 2}),
    "fsdp-checkpointed-bf16": (512, 8, 1536, 8, 2, 32000, ["rollout.max_new_tokens=256", "micro_batch_prompts=1",
                                                           "gradient_checkpointing=true", "mixed_precision=bf16"],
                               {"processes": 2}),
}
SHAPES = {**FITTED, **HELD_APART}
BASE = ["task=arithmetic", "steps=2", "prompts_per_step=4", "rollout.n=4", "eval.size=0", "export=false",
        "save_every=100", "algo.kl=topk_reverse", "algo.k=32", "algo.eta=0.9", "threads=2", "seed=0"]


def options(name: str) -> dict:
    return SHAPES[name][7] if len(SHAPES[name]) > 7 else {}


def make_model(widths: tuple, family: str, path: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from emapg.models.zoo import byte_tokenizer

    hidden, layers, inter, heads, kv, vocab = widths
    config, cls = (LlamaConfig, LlamaForCausalLM) if family == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    torch.manual_seed(0)
    model = cls(config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=inter,
                       num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096,
                       tie_word_embeddings=family != "llama", bos_token_id=0, eos_token_id=1, pad_token_id=1))
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def make_folder(name: str, root: Path) -> tuple[Path, list[str]]:
    """The shape's model folder (and its teacher's), and the overrides that name them."""
    opts = options(name)
    path = make_model(SHAPES[name][:6], opts.get("family", "qwen2"), root / name)
    extra = []
    if "teacher" in opts:
        extra.append(f"algo.teacher={make_model(opts['teacher'], 'qwen2', root / (name + '-teacher'))}")
    return path, extra


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def measure(folder: str, run: str, overrides: list[str]) -> dict:
    """Run 2 steps; the peak above the level before the run was built (the largest of the processes' under
    torchrun), and the plan's prediction for one of the processes."""
    import torch

    from emapg.config import load_config
    from emapg.models import distributed
    from emapg.models import plan as P
    from emapg.rollout.prompts import longest_prompt
    from emapg.run.trainer import Trainer

    torch.set_num_threads(2)
    cfg = load_config(None, [f"model={folder}", *BASE, *overrides])
    config = P.model_config(folder)
    P.shape_of(config)  # transformers' model classes imported before the base level, as the run's libraries are
    warm_up(folder, run, overrides)
    base_kb = status_kb("VmRSS")
    tr = Trainer(cfg, Path(run), progress=False)
    built_kb = status_kb("VmRSS") - base_kb
    phases: dict[str, float] = {}
    for method, phase in PHASES.items():
        setattr(tr, method, _phase_peak(getattr(tr, method), phase, phases, base_kb))
    seen = {"prompt": 0, "response": 0}
    rollout = tr.rollout

    def rollout_seen(step):  # the longest prompt and response the run's rollouts made
        batch = rollout(step)
        seen["prompt"] = max(seen["prompt"], batch.prompt_ids.shape[1])
        seen["response"] = max(seen["response"], batch.response_ids.shape[1])
        return batch

    tr.rollout = rollout_seen
    tr.train()
    world = distributed.world()
    names = sorted(phases)
    values = [*(phases[n] for n in names), *(float(v) for v in seen.values())]
    if world > 1:  # the largest process's peaks and lengths
        values = distributed.all_reduce(values, op="max")
    phases = dict(zip(names, values[: len(names)], strict=True))
    made = dict(zip(seen, (int(v) for v in values[len(names):]), strict=True))
    checked = P.run_plan(cfg, config, tr.run.task, tr.run.tokenizer, world=world, device="cpu")  # as train's check
    # the plan at the lengths the run made (the check's lengths are bounds with a margin)
    p = P.run_plan(cfg, config, tr.run.task, tr.run.tokenizer, world=world, device="cpu", prompt_tokens=made["prompt"],
                   response_tokens=made["response"])
    prompt = longest_prompt(tr.run.task, tr.run.tokenizer)  # the prompt length it planned for, for the record
    params = sum(t.numel() for t in tr.run.model.parameters())
    resident = sum(p.resident.values())
    planned = {ph.name: (resident + ph.total) / 2**20 for ph in p.phases}
    planned_phases = {name: max((v for k, v in planned.items() if PLAN_PHASE.get(k, k) == name), default=None)
                      for name in phases}
    return {"measured_mb": max(phases.values()) / 1024, "world": world, "planned_mb": p.peak / 2**20,
            "peak_phase": p.peak_phase, "params": params, "prompt_tokens": made["prompt"],
            "response_tokens": made["response"], "checked_mb": checked.peak / 2**20, "checked_prompt_tokens": prompt,
            "built_mb": built_kb / 1024, "resident_planned_mb": resident / 2**20,
            "phases_measured_mb": {k: v / 1024 for k, v in phases.items()}, "phases_planned_mb": planned_phases}


def warm_up(folder: str, run: str, overrides: list[str]) -> None:
    """One short step of the same run in this process and then dropped, so that what any run of this process
    loads once (the libraries' code and lazy imports, the tokenizer, the math kernels' caches, the allocator's
    arenas) sits below the base level: what is measured is what this run's sizes hold, which is what the plan
    counts."""
    import gc

    from emapg.config import load_config
    from emapg.run.trainer import Trainer

    short = ["steps=1", "rollout.max_new_tokens=8", "eval.max_new_tokens=8", "eval.size=2", "eval.at_start=false",
             "eval.every=0", "algo.ema_every=1"]
    tr = Trainer(load_config(None, [f"model={folder}", *BASE, *overrides, *short]), Path(run + "-warm"), progress=False)
    tr.train()
    tr.close()
    del tr
    gc.collect()


# the trainer's methods whose peaks are measured one by one (the peak reset as each is entered), as the
# plan's phases: a phase of the plan belongs to the method that runs it
PHASES = {"rollout": "rollout", "anchor_pass": "reference", "_optimizer_step": "update", "_evaluate": "evaluation"}
PLAN_PHASE = {"optimizer step": "update", "teacher's answers (evaluation)": "evaluation",
              "teacher KL passes (evaluation)": "evaluation", "teacher KL log-probs (evaluation)": "evaluation"}


def _phase_peak(fn, phase: str, phases: dict[str, float], base_kb: int):
    def run(*args, **kwargs):
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        try:
            return fn(*args, **kwargs)
        finally:
            phases[phase] = max(phases.get(phase, 0), status_kb("VmHWM") - base_kb)
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.add_argument("--one", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        folder, name, run, *extra = args.one
        row = measure(folder, run, [*SHAPES[name][6], *extra])
        if os.environ.get("RANK", "0") == "0":
            print(json.dumps(row))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "2"}
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for name in args.shapes:
            folder, extra = make_folder(name, Path(root))
            procs = options(name).get("processes", 1)
            launch = [sys.executable] if procs == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                          f"--nproc_per_node={procs}"]
            out = subprocess.run([*launch, __file__, "--one", str(folder), name, str(Path(root) / f"run-{name}"),
                                  *extra], capture_output=True,
                                 text=True, env=env)
            if out.returncode != 0:
                sys.exit(f"{name}: {out.stderr.strip().splitlines()[-1]}")
            r = {"shape": name, **json.loads(out.stdout.strip().splitlines()[-1])}
            rows.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "summary": summary(rows)}, indent=1))
    print(table(rows))


def ratios(row: dict) -> dict[str, float]:
    """planned / measured for each phase the run went through."""
    return {k: row["phases_planned_mb"][k] / v for k, v in row["phases_measured_mb"].items()
            if row["phases_planned_mb"].get(k)}


def summary(rows: list[dict]) -> dict[str, float]:
    """The range of planned / measured over the held-apart shapes: at the peak, and over every phase."""
    held = [r for r in rows if r["shape"] in HELD_APART] or rows
    peaks = [r["planned_mb"] / r["measured_mb"] for r in held]
    phases = [v for r in held for v in ratios(r).values()]
    return {"shapes": len(held), "peak_min": round(min(peaks), 2), "peak_max": round(max(peaks), 2),
            "phase_min": round(min(phases), 2), "phase_max": round(max(phases), 2)}


def table(rows: list[dict]) -> str:
    lines = ["| shape | held apart | model | settings | processes | planned MB | measured MB | planned / measured | "
             "each phase, planned / measured |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        hidden, layers, inter, heads, kv, vocab, over = SHAPES[r["shape"]][:7]
        opts = options(r["shape"])
        model = (f"{r['params'] / 1e6:.0f}M {opts.get('family', 'qwen2')}: h{hidden} x{layers} i{inter} kv{kv} "
                 f"V{vocab}" + (" + teacher h{} x{}".format(*opts["teacher"][:2]) if "teacher" in opts else ""))
        settings = " ".join(o if o != SEARCH else "task_args={synthetic KB, 3 turns, 320 tokens}" for o in over)
        phases = ", ".join(f"{k} {v:.2f}" for k, v in sorted(ratios(r).items()))
        lines.append(f"| {r['shape']} | {'yes' if r['shape'] in HELD_APART else 'no'} | {model} | {settings} | "
                     f"{r['world']} | {r['planned_mb']:.0f} | {r['measured_mb']:.0f} | "
                     f"{r['planned_mb'] / r['measured_mb']:.2f} ({r['peak_phase']}) | {phases} |")
    return "\n".join(lines)

if __name__ == "__main__":
    main()
