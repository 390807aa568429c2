"""How much of pi_old's probability the top-k head covers when vLLM samples under top-p: emapg's head (the k ids
vLLM returns, the top-k of its processed distribution) against the reference fork's (pi_old's own top-k from the
trainer's logits), measured side by side on the same sampled tokens. Runs in the CPU vLLM venv:

    .venv-vllm/bin/python bench/head_under_top_p.py [--out docs/results/head_under_top_p.json]

SmolLM2-135M-Instruct (fp32) answers the DeepScaleR-format training fixture's problems in the chat template,
4 samples each, 256 new tokens, T = 1.0, k = 32 (the search recipe's), at top-p 0.95 (the search recipe's) and
1.0 (no nucleus: the two heads must agree). pi_old is the model's full softmax at each response position,
recomputed row by row without padding. Per position: pi_old's mass on each head, the heads' overlap, and
whether the nucleus held fewer than k ids (where vLLM's ids beyond it are -inf ties, in no meaningful order).
The tail term's variance scales with the mass outside the head, so the ratio of tail masses is the cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from _common import ROOT, commit, machine


def positions(model, batch, k: int, top_p: float) -> list[dict]:
    out = []
    with torch.no_grad():
        for row in range(batch.response_ids.shape[0]):
            p = row // batch.n
            prompt = batch.prompt_ids[p][batch.prompt_mask[p].bool()]
            n = int(batch.response_mask[row].sum())
            ids = torch.cat([prompt, batch.response_ids[row, :n]])
            logits = model(ids[None]).logits[0, len(prompt) - 1: len(prompt) - 1 + n].float()
            probs = torch.softmax(logits, -1)
            top = probs.topk(k, -1)
            ordered = probs.sort(-1, descending=True).values.cumsum(-1)
            nucleus = (ordered < top_p).sum(-1) + 1  # ids the top-p sampler keeps
            head = batch.samp_topk[row, :n]
            emapg_mass = probs.gather(-1, head).sum(-1)
            for t in range(n):
                out.append({"fork_mass": float(top.values[t].sum()), "emapg_mass": float(emapg_mass[t]),
                            "overlap": len(set(head[t].tolist()) & set(top.indices[t].tolist())) / k,
                            "small_nucleus": bool(nucleus[t] < k)})
    return out


def summary(rows: list[dict]) -> dict:
    small = [r for r in rows if r["small_nucleus"]]
    tail = lambda key, rs: statistics.fmean(1 - r[key] for r in rs) if rs else None  # noqa: E731
    return {"positions": len(rows), "small_nucleus_share": len(small) / len(rows),
            "fork_head_mass": statistics.fmean(r["fork_mass"] for r in rows),
            "emapg_head_mass": statistics.fmean(r["emapg_mass"] for r in rows),
            "overlap": statistics.fmean(r["overlap"] for r in rows),
            "fork_tail_mass": tail("fork_mass", rows), "emapg_tail_mass": tail("emapg_mass", rows),
            "small_nucleus_fork_tail": tail("fork_mass", small), "small_nucleus_emapg_tail": tail("emapg_mass", small),
            "small_nucleus_overlap": statistics.fmean(r["overlap"] for r in small) if small else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the measurements as JSON here")
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    from emapg.models.zoo import load_model
    from emapg.rollout import vllm_backend as vb
    from emapg.rollout.sampling import SamplingSpec, eos_ids
    from emapg.tasks import make_task

    k = 32
    model, tok = load_model("smollm2-135m", "float32", seed=0)
    task = make_task("math", train_file=str(ROOT / "tests/fixtures/evalsets/deepscaler_train.json"),
                     eval_file=str(ROOT / "tests/fixtures/evalsets/math500.jsonl"), template="chat")
    examples = task.train_pool()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        engine = vb.VLLMRollout.create(model, tok, eos_ids(model, tok), workdir=Path(tmp), dtype="float32",
                                       device="cpu", gpu_memory_utilization=0.2, max_model_len=1024, max_logprobs=k,
                                       seed=0, sleep=False, enforce_eager=True, cpu_kv_cache_gib=1)
        try:
            engine.sync(model, version=0)
            for top_p in (0.95, 1.0):
                spec = SamplingSpec(n=4, temperature=1.0, top_p=top_p, max_new_tokens=args.tokens, k=k)
                batch = engine.generate(examples, spec, seed=1)
                results[str(top_p)] = summary(positions(model, batch, k, top_p))
                r = results[str(top_p)]
                print(f"top-p {top_p}: {r['positions']} positions; pi_old's mass on the head: fork (pi_old top-{k}) "
                      f"{r['fork_head_mass']:.4f}, emapg (vLLM's) {r['emapg_head_mass']:.4f}; tail mass "
                      f"{r['fork_tail_mass']:.4f} vs {r['emapg_tail_mass']:.4f}; overlap {r['overlap']:.3f}; "
                      f"nucleus < {k} ids at {r['small_nucleus_share']:.1%} of positions", flush=True)
        finally:
            engine.close()
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine(), "commit": commit(), "k": k, "model":
                                              "smollm2-135m", "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
