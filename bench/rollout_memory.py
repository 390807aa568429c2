"""Peak memory of one HF rollout as the number of rows grows: every row at once (rollout.max_rows
null) against at most --bound rows at a time (rows joining as others finish), side by side in one run.

The model is Qwen2-shaped with a cache-heavy body (hidden 512, 8 layers, 8 key/value heads of 64:
32 KiB of fp32 cache per token) and a 32,768-token vocabulary, random weights; prompts of 48 tokens,
n = 8 samples each, --tokens new tokens per row, no end-of-sequence token (every row runs its whole
budget, the worst case for the cache). Sampling at temperature 1 with the top-32 ids recorded.
Each row of the table runs in its own process; peak memory is the highest resident set size, sampled
every 2 ms, above the level just before the rollout.

    python bench/rollout_memory.py
    python bench/rollout_memory.py --rows 32 256 --tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _common import PeakRSS

VOCAB, HIDDEN, LAYERS, KV_HEADS, PROMPT, N, K = 32768, 512, 8, 8, 48, 8, 32


def one(rows: int, bound: int | None, tokens: int) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from emapg.rollout.hf import decode_pool
    from emapg.rollout.sampling import SamplingSpec

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=8,
        num_key_value_heads=KV_HEADS, intermediate_size=2 * HIDDEN, max_position_embeddings=4096,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=None, pad_token_id=0)).eval()
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(2, VOCAB, (rows // N, PROMPT), generator=g).tolist()
    spec = SamplingSpec(n=N, max_new_tokens=tokens, k=K)
    with torch.no_grad(), PeakRSS() as meter:
        t0 = time.perf_counter()
        out = decode_pool(model, prompts, spec, max_rows=bound or rows, eos=[], pad_id=0)
        seconds = time.perf_counter() - t0
    assert int(out.length.min()) == tokens
    return {"rows": rows, "bound": bound, "tokens": tokens, "peak_extra_mb": meter.extra, "seconds": seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[32, 64, 128, 256])
    p.add_argument("--bound", type=int, default=32)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        import torch

        spec = json.loads(args.one)
        torch.set_num_threads(spec.pop("threads"))
        print(json.dumps(one(**spec)))
        return
    results = {}
    for rows in args.rows:
        for bound in (None, args.bound):
            spec = dict(rows=rows, bound=bound, tokens=args.tokens, threads=args.threads)
            out = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True, text=True)
            if out.returncode != 0:
                sys.exit(f"rows {rows} bound {bound}: {out.stderr.strip().splitlines()[-1]}")
            results[rows, bound] = json.loads(out.stdout.strip().splitlines()[-1])
            print(json.dumps(results[rows, bound]), file=sys.stderr, flush=True)
    kib = 2 * LAYERS * KV_HEADS * (HIDDEN // 8) * 4 / 1024
    print(f"\nQwen2-shaped, vocab {VOCAB}, hidden {HIDDEN}, {LAYERS} layers, {kib:.0f} KiB of cache per token, "
          f"prompts of {PROMPT} x n={N}, {args.tokens} new tokens, {args.threads} threads; peak resident memory "
          "above the level before the rollout\n")
    print(f"| rows | every row at once MB | at most {args.bound} rows MB | at once s | bounded s |")
    print("|---|---|---|---|---|")
    for rows in args.rows:
        a, b = results[rows, None], results[rows, args.bound]
        print(f"| {rows} | {a['peak_extra_mb']:.0f} | {b['peak_extra_mb']:.0f} | {a['seconds']:.1f} | "
              f"{b['seconds']:.1f} |")


if __name__ == "__main__":
    main()
