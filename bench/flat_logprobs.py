"""vLLM's log-probs read flat (one object per request) against per-token dicts (k + 1 ``Logprob`` objects per
token), side by side on the CPU vLLM build: the whole rollout (vLLM's sampler output, its detokenizer-free output
processing, emapg's reading into tensors) and emapg's reading alone, in seconds per million sampled tokens.

    .venv-vllm/bin/python bench/flat_logprobs.py [--out docs/results/flat_logprobs.json]

tiny-llama-h32 (a random 4-layer Llama, vocabulary 256: the model's own cost is small, so what is measured is
mostly the log-prob handling), 16 prompts x 4 samples x 128 tokens (no end-of-sequence: every row runs its
budget), k = 32 (the search recipe's), temperature 1. Rounds alternate flat and dicts, same seeds; medians of 5.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import commit, machine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the measurements as JSON here")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from emapg.models.zoo import load_model
    from emapg.rollout import vllm_backend as vb
    from emapg.rollout.sampling import SamplingSpec
    from emapg.tasks import make_task

    model, tok = load_model("tiny-llama-h32", "float32", seed=0)
    examples = make_task("arithmetic", digits=2).eval_examples(16)
    spec = SamplingSpec(n=4, temperature=1.0, max_new_tokens=128, k=32)
    times: dict[str, dict[str, list[float]]] = {m: {"rollout": [], "reading": []} for m in ("flat", "dicts")}
    tokens = 0
    with tempfile.TemporaryDirectory() as tmp:
        engine = vb.VLLMRollout.create(model, tok, [], workdir=Path(tmp), dtype="float32", device="cpu",
                                       gpu_memory_utilization=0.2, max_model_len=512, max_logprobs=32, seed=0,
                                       sleep=False, enforce_eager=True, cpu_kv_cache_gib=1)
        try:
            engine.sync(model, version=0)
            engine.generate(examples[:4], spec, seed=0)  # warm-up
            for r in range(args.rounds):
                for mode in ("flat", "dicts") if r % 2 == 0 else ("dicts", "flat"):
                    vb.FLAT_LOGPROBS = mode == "flat"
                    t0 = time.perf_counter()
                    batch = engine.generate(examples, spec, seed=r)
                    times[mode]["rollout"].append(time.perf_counter() - t0)
                    prompts = [vb.format_prompt(engine.tokenizer, ex.messages) for ex in examples]
                    requests = [(p, spec, vb.stream_seed(r, "prompt", i)) for i, p in enumerate(prompts)]
                    raw = engine._generate_many(requests)
                    rows = [c for o in raw for c in o.outputs]
                    t0 = time.perf_counter()
                    vb.to_sampled(rows, spec.k, tok.pad_token_id)
                    times[mode]["reading"].append(time.perf_counter() - t0)
                    tokens = int(batch.response_mask.sum())
        finally:
            engine.close()
    per_m = {m: {k: statistics.median(v) / tokens * 1e6 for k, v in t.items()} for m, t in times.items()}
    for part in ("rollout", "reading"):
        print(f"{part:8s}: flat {per_m['flat'][part]:8.2f} s, dicts {per_m['dicts'][part]:8.2f} s per million tokens "
              f"(dicts / flat {per_m['dicts'][part] / per_m['flat'][part]:.2f}x)")
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine(), "commit": commit(), "tokens_per_round": tokens,
                                              "rounds": args.rounds, "seconds_per_million_tokens": per_m,
                                              "raw_seconds": times}, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
