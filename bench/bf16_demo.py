"""The CPU demo in bf16 against fp32, on one machine, one after the other: is ``mixed_precision: auto`` (bf16
autocast where the CPU computes bf16 natively: AMX-BF16 or AVX512-BF16) worth making the demo's setting?

    python bench/bf16_demo.py [--out docs/results/bf16_demo.json] [--steps 30]

Runs ``emapg train`` (the demo recipe, cpu_demo.yaml: SmolLM2-135M-Instruct, 2-digit addition, 30 steps, the
held-out 200 problems greedy at steps 0, 10, 20, 30) with the recipe as shipped (fp32) and with
``mixed_precision=bf16``, the same seed. Records, for each: held-out accuracy of the policy and the anchor at
every evaluation, the seconds of generation, of the update (anchor pass and policy passes) and of the whole
steps (metrics' gen_seconds, anchor_seconds, step_seconds, summed), the wall time of the run (evaluations
included); and the paired comparison of the two final policies (and anchors) on the same 200 problems: how many
only one solved, McNemar's exact p. One seed: a difference in accuracy within the paired test's noise says the
two are not told apart here, not that they are equal. Refuses to run on a CPU without native bf16 (autocast
there emulates it, slower than fp32).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, commit, machine

PRECISIONS = {"fp32": [], "bf16": ["mixed_precision=bf16"]}


def run_demo(out: Path, overrides: list[str]) -> float:
    """``emapg train`` (the demo) into ``out``; its wall seconds."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "emapg", "train", "--out", str(out), *overrides]
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def record(run: Path, wall: float) -> dict:
    from emapg.run.metrics import read_metrics

    rows = read_metrics(run)
    final = json.loads((run / "eval.json").read_text())
    out = {k: v["accuracy"] for k, v in final.items() if isinstance(v, dict) and "accuracy" in v}
    for model in ("policy", "anchor"):
        out[f"{model}_by_step"] = {str(r["step"]): r[f"eval/{model}_accuracy"] for r in rows
                                   if f"eval/{model}_accuracy" in r}
    for key in ("gen_seconds", "anchor_seconds", "step_seconds"):
        out[key] = round(sum(r.get(key, 0.0) for r in rows), 1)
    out["update_seconds"] = round(out["step_seconds"] - out["gen_seconds"], 1)
    out["wall_seconds"] = round(wall, 1)
    rewards = [r["reward_mean"] for r in rows if "reward_mean" in r]
    out["reward_last5"] = round(sum(rewards[-5:]) / len(rewards[-5:]), 3)  # the training reward at the end
    return out


def paired(a: Path, b: Path, model: str) -> dict:
    from emapg.run.outcomes import final_outcomes
    from emapg.stats import mcnemar_p

    x, y = final_outcomes(a, model), final_outcomes(b, model)
    if x[0] != y[0]:
        raise SystemExit(f"{model}: the two runs evaluated different problems")
    only_fp32, only_bf16, p = mcnemar_p(x[1], y[1])
    return {"problems": len(x[1]), "only_fp32": only_fp32, "only_bf16": only_bf16, "mcnemar_p": round(p, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write the record to this JSON file")
    p.add_argument("--steps", type=int, default=30, help="training steps of each run (the demo's 30)")
    args = p.parse_args()
    import torch

    from emapg.models.distributed import native_bf16

    native, why = native_bf16(torch.device("cpu"))
    if not native:
        raise SystemExit(f"this CPU has no native bf16 ({why}): nothing to measure")
    result = {"machine": machine(), "commit": commit(), "cpu_bf16": why, "command": "python bench/bf16_demo.py",
              "steps": args.steps, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for name, overrides in PRECISIONS.items():
            runs[name] = Path(tmp) / name
            wall = run_demo(runs[name], [*overrides, f"steps={args.steps}"])
            result["runs"][name] = record(runs[name], wall)
            print(name, json.dumps(result["runs"][name]), flush=True)
        result["paired"] = {m: paired(runs["fp32"], runs["bf16"], m) for m in ("policy", "anchor")}
    f, b = result["runs"]["fp32"], result["runs"]["bf16"]
    result["speedup"] = {k: round(f[k] / b[k], 2) for k in ("gen_seconds", "update_seconds", "step_seconds",
                                                            "wall_seconds") if b[k]}
    print(json.dumps({"paired": result["paired"], "speedup": result["speedup"]}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
