"""Peak memory at the paper's vocabulary: one rollout, and one training micro-batch (forward and
backward), before and after emapg's O(k) sampler and its head autograd function, side by side.

The model is Qwen2.5-shaped with the real 151,936-token vocabulary (tied embeddings) but a small
body (hidden 512, 2 layers), so it runs on a 2-core CPU while the vocabulary-sized tensors (what
grows with response length) are true to scale. Each row runs in its own process; peak memory is
the highest resident set size, sampled every 2 ms, above the level just before the measured work.

Rollout (2 rows, sampling at temperature 1, top-32 ids recorded, no end-of-sequence token):
  before   ``model.generate`` with output_scores: every step's [rows, vocab] fp32 scores kept to the
           end, statistics computed from them (emapg's HF backend until this change)
  after    emapg's decode loop: statistics recorded per step, one step's [rows, vocab] alive
Training micro-batch (1 row, N response tokens after a 64-token prompt, top-32 ids gathered,
chunks of --chunk positions):
  before   per-chunk ``torch.utils.checkpoint`` around the head: autograd sums the chunks' [V, H]
           weight gradients out of place
  after    emapg's head autograd function: the weight gradient accumulated in place

    python bench/scale_memory.py
    python bench/scale_memory.py --tokens 256 1024 --chunk 256
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

VOCAB, HIDDEN, LAYERS, K, PROMPT = 151936, 512, 2, 32, 64


def _model():
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=8,
                      num_key_value_heads=2, intermediate_size=2 * HIDDEN, max_position_embeddings=16384,
                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    return Qwen2ForCausalLM(cfg).eval()


def _old_token_logprobs(hidden, weight, tokens, *, ids=None, bias=None, temperature=1.0, k_self=0, entropy=False,
                        chunk_size=1024):
    """emapg's head before its autograd function: torch.utils.checkpoint per chunk (values only)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from emapg.models.lm import TokenLogprobs

    def stats(h, t, i):
        logits = torch.nn.functional.linear(h, weight, bias).float() / temperature
        nll = torch.nn.functional.cross_entropy(logits, t, reduction="none")
        picked = logits.gather(-1, torch.cat([t[:, None], i], -1))
        lse = picked[:, 0] + nll
        return -nll, lse, picked[:, 1:] - lse[:, None]

    recompute = hidden.shape[0] > chunk_size
    parts = []
    for s in range(0, hidden.shape[0], chunk_size):
        args = (hidden[s : s + chunk_size], tokens[s : s + chunk_size], ids[s : s + chunk_size])
        parts.append(checkpoint(stats, *args, use_reentrant=False) if recompute else stats(*args))
    tok, lse, at = (torch.cat(list(c)) for c in zip(*parts, strict=True))
    return TokenLogprobs(logp_tok=tok, lse=lse, logp_ids=at)


def rollout(side: str, tokens: int, rows: int = 2) -> dict:
    import torch

    model = _model()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (rows, PROMPT), generator=g)
    mask = torch.ones_like(ids)
    torch.manual_seed(0)
    with torch.no_grad(), PeakRSS() as meter:
        t0 = time.perf_counter()
        if side == "before":
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens,
                                 do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0,
                                 output_scores=True, return_dict_in_generate=True)
            resp = out.sequences[:, PROMPT:]
            for t, scores in enumerate(out.scores):
                logp = torch.log_softmax(scores.float(), -1)
                logp.gather(-1, resp[:, t : t + 1])
                logp.topk(K, -1)
            n = resp.shape[1]
        else:
            from emapg.rollout.hf import decode
            from emapg.rollout.sampling import SamplingSpec

            out, _ = decode(model, ids, mask, None, SamplingSpec(k=K), max_new_tokens=tokens, eos=[], pad_id=0,
                            keep_state=False)
            n = out.ids.shape[1]
        seconds = time.perf_counter() - t0
    return {"part": "rollout", "side": side, "tokens": tokens, "generated": n, "rows": rows,
            "peak_extra_mb": meter.extra, "seconds": seconds}


def train(side: str, tokens: int, chunk: int) -> dict:
    import torch

    import emapg.models.forward as fwd
    from emapg.rollout.sampling import RolloutBatch

    if side == "before":
        fwd.token_logprobs = _old_token_logprobs
    model = _model()
    model.train(False)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(2, VOCAB, (1, PROMPT), generator=g)
    resp = torch.randint(2, VOCAB, (1, tokens), generator=g)
    mb = RolloutBatch(prompt_ids=prompt, prompt_mask=torch.ones_like(prompt), response_ids=resp,
                      response_mask=torch.ones_like(resp), samp_logp=torch.zeros(1, tokens), n=1)
    head_ids = torch.randint(0, VOCAB, (tokens, K), generator=g)
    with PeakRSS() as meter:
        t0 = time.perf_counter()
        st = fwd.response_logprobs(model, mb, ids=head_ids, chunk_size=chunk)
        loss = st.logp_tok.mean() + st.logp_ids.exp().sum(-1).mean()
        loss.backward()
        seconds = time.perf_counter() - t0
    return {"part": "train", "side": side, "tokens": tokens, "chunk": chunk,
            "chunks": -(-tokens // chunk), "peak_extra_mb": meter.extra, "seconds": seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--parts", nargs="+", default=["rollout", "train"], choices=["rollout", "train"])
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        import torch

        spec = json.loads(args.one)
        torch.set_num_threads(spec.pop("threads"))
        part = spec.pop("part")
        print(json.dumps(rollout(**spec) if part == "rollout" else train(**spec)))
        return
    specs = []
    for part in args.parts:
        for n in args.tokens:
            for side in ("before", "after"):
                spec = dict(part=part, side=side, tokens=n, threads=args.threads)
                specs.append(spec if part == "rollout" else {**spec, "chunk": args.chunk})
        if part == "train":  # the same length in one chunk: what more chunks add
            n = max(args.tokens)
            specs += [dict(part=part, side=s, tokens=n, threads=args.threads, chunk=n) for s in ("before", "after")]
    rows = []
    for spec in specs:
        out = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True, text=True)
        if out.returncode != 0:
            rows.append({**spec, "peak_extra_mb": None, "note": out.stderr.strip().splitlines()[-1][-160:]})
        else:
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(f"\nQwen2.5-shaped, vocab {VOCAB}, hidden {HIDDEN}, {LAYERS} layers, {args.threads} threads; "
          "peak resident memory above the level before the work\n")
    for part, head in (("rollout", "| part | response tokens | rows | before MB | after MB | before s | after s |"),
                       ("train", "| part | response tokens | chunks | before MB | after MB | before s | after s |")):
        sel = [r for r in rows if r["part"] == part]
        if not sel:
            continue
        print(head)
        print("|---|---|---|---|---|---|---|")
        keys = sorted({(r["tokens"], r.get("chunks", r.get("rows"))) for r in sel if "note" not in r})
        for n, c in keys:
            b = next((r for r in sel if r["side"] == "before" and r["tokens"] == n
                      and r.get("chunks", r.get("rows")) == c), None)
            a = next((r for r in sel if r["side"] == "after" and r["tokens"] == n
                      and r.get("chunks", r.get("rows")) == c), None)
            cell = lambda r, key, fmt: "-" if r is None or r.get(key) is None else format(r[key], fmt)  # noqa: E731
            print(f"| {part} | {n} | {c} | {cell(b, 'peak_extra_mb', '.0f')} | {cell(a, 'peak_extra_mb', '.0f')} "
                  f"| {cell(b, 'seconds', '.1f')} | {cell(a, 'seconds', '.1f')} |")
        for r in sel:
            if "note" in r:
                print(f"\n{part} {r['side']} {r['tokens']}: failed: {r['note']}")
        print()


if __name__ == "__main__":
    main()
