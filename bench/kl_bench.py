"""Time and peak memory of the KL + log-prob path of the policy pass (forward + backward).

Methods, on the same hidden states and output projection:
  logprob   the sampled token's log-prob alone (chunked): the cost any PG method pays
  k3        + the k3 estimator (needs the anchor's log-prob of the sampled token only)
  topk32    + the top-k reverse estimator, k = 32, lean form (gathers 32 logits per position)
  exact     the exact full-vocabulary reverse KL on materialised [N, V] logits (the naive way)

Each (method, vocab, positions) runs in its own subprocess. Peak memory is the highest resident
set size seen by a sampling thread (every 2 ms) during the timed passes, above the resident size
just before them. Times are medians over --reps.

    python bench/kl_bench.py                      # the table in docs/BENCHMARKS.md
    python bench/kl_bench.py --vocab 49152 --positions 1024 2048 --reps 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from _common import PeakRSS

METHODS = ("logprob", "k3", "topk32", "exact")


def run_one(method: str, vocab: int, n: int, hidden: int, reps: int, chunk: int, threads: int) -> dict:
    import torch

    from emapg import kl
    from emapg.models.lm import token_logprobs

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, hidden, generator=g) * 0.5
    w = torch.randn(vocab, hidden, generator=g) * 0.02
    w_anchor = w + 0.002 * torch.randn(vocab, hidden, generator=g)
    tokens = torch.randint(0, vocab, (n,), generator=g)
    with torch.no_grad():  # what the rollout and the anchor pass hand to the policy pass: [N] and [N, k]
        samp = token_logprobs(h, w, tokens, k_self=32, chunk_size=chunk)
        anc = token_logprobs(h, w_anchor, tokens, ids=samp.topk_ids, chunk_size=chunk)
        anchor_full = None
        if method == "exact":
            anchor_full = torch.log_softmax(h @ w_anchor.T, -1)
    del g
    times = []
    meter = PeakRSS().__enter__()
    for _ in range(reps):
        hh = h.clone().requires_grad_(True)
        ww = w.clone().requires_grad_(True)
        t0 = time.perf_counter()
        if method == "exact":
            logp = torch.log_softmax(hh @ ww.T, -1)
            loss = (logp.exp() * (logp - anchor_full)).sum(-1).mean()
        else:
            ids = samp.topk_ids if method == "topk32" else None
            pol = token_logprobs(hh, ww, tokens, ids=ids, chunk_size=chunk)
            if method == "logprob":
                loss = pol.logp_tok.mean()
            elif method == "k3":
                loss = kl.kl_from_logprobs("k3", pol.logp_tok, anc.logp_tok, samp_logp_tok=samp.logp_tok).mean()
            else:
                in_q = (samp.topk_ids == tokens[:, None]).any(-1)
                loss = kl.kl_from_logprobs("topk_reverse", pol.logp_tok, anc.logp_tok, samp_logp_tok=samp.logp_tok,
                                           policy_logp_q=pol.logp_ids, anchor_logp_q=anc.logp_ids, in_q=in_q).mean()
        loss.backward()
        times.append(time.perf_counter() - t0)
        del hh, ww, loss
    meter.__exit__(None, None, None)
    return {"method": method, "vocab": vocab, "positions": n, "seconds": statistics.median(times),
            "peak_extra_mb": meter.peak - meter.base}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, nargs="+", default=[49152, 151936])
    p.add_argument("--positions", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-exact-gb", type=float, default=12.0, help="skip 'exact' above this estimate")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_one(**json.loads(args.one))))
        return
    rows = []
    for vocab in args.vocab:
        for n in args.positions:
            for method in args.methods:
                est_gb = 4 * n * vocab * 5 / 1e9  # logits, log-probs, probs, anchor, grads
                if method == "exact" and est_gb > args.max_exact_gb:
                    rows.append({"method": method, "vocab": vocab, "positions": n, "seconds": None,
                                 "peak_extra_mb": None, "note": f"skipped: ~{est_gb:.0f} GB"})
                    continue
                spec = dict(method=method, vocab=vocab, n=n, hidden=args.hidden, reps=args.reps, chunk=args.chunk,
                            threads=args.threads)
                out = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True,
                                     text=True)
                if out.returncode != 0:
                    rows.append({**spec, "seconds": None, "peak_extra_mb": None, "note": out.stderr[-200:]})
                    continue
                rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(f"hidden {args.hidden}, chunk {args.chunk}, {args.threads} threads, median of {args.reps}, "
          "forward + backward of the policy side\n")
    print("| vocab | positions | method | seconds | vs logprob | peak extra MB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        base = next((x["seconds"] for x in rows if x["method"] == "logprob" and x["vocab"] == r["vocab"]
                     and x["positions"] == r["positions"]), None)
        if r["seconds"] is None:
            print(f"| {r['vocab']} | {r['positions']} | {r['method']} | {r.get('note', 'failed')} | | |")
            continue
        ratio = f"{r['seconds'] / base:.3f}x" if base else ""
        print(f"| {r['vocab']} | {r['positions']} | {r['method']} | {r['seconds']:.2f} | {ratio} "
              f"| {r['peak_extra_mb']:.0f} |")


if __name__ == "__main__":
    main()
