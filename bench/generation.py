"""Seconds per rollout on this CPU: Hugging Face ``generate`` (dynamic cache, static cache, static
cache + torch.compile) against our decode loop, in the demo's shapes, side by side in one run.

Work per rollout: SmolLM2-135M-Instruct (fp32), 8 two-digit-addition prompts x 4 samples, at most
32 new tokens, temperature 1, the per-token statistics emapg records (sampled log-prob, entropy,
top-32 ids). Every variant draws with the same seed; times are medians over --reps after one
warm-up rollout (for torch.compile the warm-up includes compiling, reported on its own).

  generate           model.generate with output_scores, statistics computed from the kept scores
                     at the end (emapg's HF backend before its own loop), prompts run n times
  generate-shared    the same, the prompt's cache computed once per group and repeated (what
                     emapg's HF backend did)
  generate-static    cache_implementation="static" (prompts run n times: a static cache cannot
                     take a repeated prefix)
  generate-compiled  static cache + torch.compile of the forward (inductor, CPU)
  loop-multinomial   our decode loop with generate's draw (torch.multinomial), HF's DynamicCache,
                     every row to the end: generate's work through our loop
  loop               our decode loop as shipped: inverse-CDF draw, reserved cache, finished rows
                     leave the batch, prompt shared per group
  vllm               vLLM's CPU build (rollout.backend=vllm): the engine emapg starts (dummy weights,
                     the policy's pushed, eager, fp32, prefix caching), sampled log-prob and top-32 ids
                     returned per token; its start and weight push are the warm-up. Needs .venv-vllm.

    python bench/generation.py --reps 3
    python bench/generation.py --reps 3 --skip-compile
    # vLLM against our loop (in the vLLM venv, which has the project too), several shapes in one run:
    .venv-vllm/bin/python bench/generation.py --reps 3 --variants loop vllm \
        --shapes smollm2-135m:32 smollm2-135m:256 random-qwen2.5-0.5b:32
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch

PROMPTS, SAMPLES, MAX_NEW, K = 8, 4, 32, 32


def _scores_stats(out, prompt_len: int, eos: list[int]) -> int:
    """emapg's old HF backend: statistics from generate's kept [rows, vocab] scores, one step at a time.
    Returns the generated tokens (each row up to and including its first EOS), as the loop counts them."""
    resp = out.sequences[:, prompt_len:]
    for t, scores in enumerate(out.scores):
        logp = torch.log_softmax(scores.float(), -1)
        logp.gather(-1, resp[:, t : t + 1])
        -(logp.exp() * logp.masked_fill(torch.isinf(logp), 0.0)).sum(-1)
        logp.topk(K, -1)
    is_eos = torch.isin(resp, torch.tensor(eos, device=resp.device))
    return int((is_eos.long().cumsum(1) - is_eos.long() == 0).sum())  # no EOS before the token


def _generate(model, tok, ids, mask, *, shared: bool = False, static: bool = False, compiled: bool = False):
    from emapg.rollout.hf import prefill
    from emapg.rollout.sampling import eos_ids

    kw = dict(max_new_tokens=MAX_NEW, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
              eos_token_id=eos_ids(model, tok), pad_token_id=tok.pad_token_id, output_scores=True,
              return_dict_in_generate=True)
    if static:
        kw["cache_implementation"] = "static"
    if compiled:
        from transformers import CompileConfig

        cc = CompileConfig(fullgraph=False, dynamic=False, mode="default")
        cc._compile_all_devices = True  # generate compiles only on accelerators unless told
        kw["compile_config"] = cc
    if shared:
        from transformers import DynamicCache

        state = prefill(model, ids[:, :-1], mask[:, :-1], repeat=SAMPLES)
        cache = DynamicCache(config=model.config)  # generate wants its own cache class: copy ours in
        for i, layer in enumerate(state.cache.layers):
            cache.update(layer.keys.clone(), layer.values.clone(), i)
        inputs = dict(input_ids=ids.repeat_interleave(SAMPLES, 0), attention_mask=mask.repeat_interleave(SAMPLES, 0),
                      cache=cache)
    else:
        inputs = dict(input_ids=ids, attention_mask=mask, num_return_sequences=SAMPLES)
    out = model.generate(**inputs, **kw)
    return _scores_stats(out, ids.shape[1], kw["eos_token_id"])


def _loop(model, tok, ids, mask, *, multinomial: bool = False):
    import emapg.rollout.hf as dec
    from emapg.rollout.sampling import SamplingSpec, eos_ids, pad_left

    contexts = [r[m.bool()].tolist() for r, m in zip(ids, mask, strict=True) for _ in range(SAMPLES)]
    if multinomial:
        saved = dec.draw, dec.COMPACT_BELOW, dec.new_cache
        dec.draw = lambda probs, u: torch.multinomial(probs, 1).squeeze(1)
        dec.COMPACT_BELOW = 0.0
        from transformers import DynamicCache

        dec.new_cache = lambda model, spare=0: DynamicCache(config=model.config)
        try:
            rows, rmask = pad_left(contexts, tok.pad_token_id)
            out, _ = dec.decode(model, rows, rmask, None, SamplingSpec(k=K), max_new_tokens=MAX_NEW,
                                eos=eos_ids(model, tok), pad_id=tok.pad_token_id, keep_state=False)
        finally:
            dec.draw, dec.COMPACT_BELOW, dec.new_cache = saved
        return int(out.length.sum())
    from emapg.rollout.hf import HFSampler
    from emapg.rollout.sampling import SamplingSpec

    out = HFSampler(model, tok, SamplingSpec(k=K), reuse_cache=False)(contexts, MAX_NEW)
    return int(out.length.sum())


class _Engine:
    """The vLLM engine for one model and length, started on first use (the warm-up) and kept."""

    engine = None

    @classmethod
    def run(cls, model, tok, ids, mask):
        from emapg.rollout import vllm_backend as vb
        from emapg.rollout.sampling import SamplingSpec, eos_ids

        if cls.engine is None:
            import tempfile

            cls.engine = vb.VLLMRollout.create(
                model, tok, eos_ids(model, tok), workdir=tempfile.mkdtemp(prefix="emapg-bench-"), dtype="float32",
                device="cpu", gpu_memory_utilization=0.3, max_model_len=ids.shape[1] + MAX_NEW + 64,
                max_logprobs=K, seed=0, sleep=False, enforce_eager=True, cpu_kv_cache_gib=2)
            cls.engine.sync(model, version=0)
        contexts = [r[m.bool()].tolist() for r, m in zip(ids, mask, strict=True) for _ in range(SAMPLES)]
        out = cls.engine.sample(contexts, MAX_NEW, SamplingSpec(k=K), seed=int(torch.randint(0, 2**31, ())))
        return int(out.length.sum())

    @classmethod
    def close(cls):
        if cls.engine is not None:
            cls.engine.close()
            cls.engine = None


VARIANTS = {
    "generate": lambda m, t, i, a: _generate(m, t, i, a),
    "generate-shared": lambda m, t, i, a: _generate(m, t, i, a, shared=True),
    "generate-static": lambda m, t, i, a: _generate(m, t, i, a, static=True),
    "generate-compiled": lambda m, t, i, a: _generate(m, t, i, a, static=True, compiled=True),
    "loop-multinomial": lambda m, t, i, a: _loop(m, t, i, a, multinomial=True),
    "loop": lambda m, t, i, a: _loop(m, t, i, a),
    "vllm": _Engine.run,
}


def main() -> None:
    global MAX_NEW
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip-compile", action="store_true")
    p.add_argument("--variants", nargs="+", default=[v for v in VARIANTS if v != "vllm"], choices=list(VARIANTS))
    p.add_argument("--shapes", nargs="+", default=[f"smollm2-135m:{MAX_NEW}"],
                   help="MODEL:MAX_NEW_TOKENS, each a table (a built-in model name or a folder)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tables = []
    for shape in args.shapes:
        name, _, new = shape.rpartition(":")
        MAX_NEW = int(new)
        tables.append((name, MAX_NEW, _measure(name, args)))
    for name, new, rows in tables:
        base_name = "generate-shared" if any(r[0] == "generate-shared" for r in rows) else rows[0][0]
        base = next(r[1] for r in rows if r[0] == base_name)
        print(f"\n{name}: {PROMPTS} prompts x {SAMPLES} samples, <= {new} new tokens, top-{K} recorded, "
              f"{args.threads} threads, median of {args.reps}\n")
        print(f"| variant | s/rollout (median) | vs {base_name} | tokens | warm-up s | all s |")
        print("|---|---|---|---|---|---|")
        for variant, med, warm, times, tokens in rows:
            print(f"| {variant} | {med:.2f} | {med / base:.2f}x | {tokens} | {warm:.1f} | "
                  f"{', '.join(f'{t:.2f}' for t in times)} |")


def _measure(model_name: str, args) -> list[tuple]:
    from emapg.models.zoo import load_model
    from emapg.rollout.sampling import format_prompt, pad_left
    from emapg.tasks import make_task

    model, tok = load_model(model_name)
    model.eval()
    examples = make_task("arithmetic", digits=2, ops="+", terms=2).train_examples(random.Random(0), PROMPTS)
    ids, mask = pad_left([format_prompt(tok, ex.messages) for ex in examples], tok.pad_token_id)
    rows = []
    for name in args.variants:
        if name == "generate-compiled" and args.skip_compile:
            continue
        fn = VARIANTS[name]
        with torch.no_grad():
            torch.manual_seed(0)
            t0 = time.perf_counter()
            fn(model, tok, ids, mask)
            warm = time.perf_counter() - t0
            times, tokens = [], 0
            for rep in range(args.reps):
                torch.manual_seed(rep + 1)
                t0 = time.perf_counter()
                tokens = fn(model, tok, ids, mask)
                times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        rows.append((name, med, warm, times, tokens))
        print(f"{model_name} <= {MAX_NEW} tokens, {name}: {med:.2f} s (warm-up {warm:.1f} s)", flush=True)
    _Engine.close()
    return rows


if __name__ == "__main__":
    main()
