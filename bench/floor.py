"""The step's compute floor against the measured step, phase by phase: how far emapg's RL step is from what its
matrix products alone cost on this machine.

    python bench/floor.py [--steps 4] [--out docs/results/floor.json]

The work is bench/vs_trl.py's EMA-PG side: SmolLM2-135M-Instruct (fp32, CPU), 8 two-digit-addition prompts x 4
samples, at most 32 new tokens, the EMA anchor and the top-k reverse KL (k = 32), one micro-batch. Per step,
from the rollout's own token counts:

* FLOPs by phase, from the model's config: generation (each prompt's prefill once, then one token per row per
  step: the layers' matrix products, attention over the cache, and the LM head, whose logits every decoding
  step needs), the anchor's no-grad pass (each prompt once with prefix sharing, then the responses; the head
  only at response positions), the policy's forward and backward (3x the forward);
* the machine's fp32 GEMM rate, measured in the same run at each phase's shapes (the layers' products at the
  phase's rows, and the head's [rows, hidden] x [hidden, vocabulary]);
* the floor: each phase's FLOPs at its measured rate; beside it the measured seconds (metrics' gen_seconds,
  anchor_seconds, and the rest of step_seconds as the update), and their ratio;
* generation's second floor, its layers at the rate of products that read their weights from memory (every
  layer's own matrices in turn, as a decoding step of 32 rows does once per token; one matrix repeated stays
  in cache and runs faster than any decoding step can).

The update, by part: each part timed inside the step (the policy's forward with the loss, its backward, the
gradient clip, AdamW's step, the EMA update, the rest), the products' parts against their FLOP floor and the
parts that multiply nothing (AdamW, the clip, the EMA: each reads and writes every parameter's fp32 state)
against a memory floor, their bytes at this machine's copy bandwidth measured in the same run.

Step 1 is a warm-up; medians over the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from _common import commit, machine

PROMPTS, SAMPLES, MAX_NEW = 8, 4, 32


def gemm_rate(m: int, k: int, n: int, seconds: float = 1.0) -> float:
    """Measured fp32 FLOP/s of [m, k] x [k, n] on this machine: the fastest of repeated products (what the machine
    can do, which a floor asks; a median would fold in whatever else the machine ran meanwhile)."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b  # warm-up
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 5:
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * m * k * n / min(times)


def streamed_rate(cfg, rows: int, seconds: float = 1.0) -> float:
    """Measured fp32 FLOP/s of the layers' products at ``rows`` rows as a decoding step runs them: every layer's
    own weights in turn (the model's whole set, far larger than the CPU's caches, so each product reads its
    weights from memory, where :func:`gemm_rate`'s one matrix stays in cache)."""
    h, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    shapes = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]
    weights = [torch.randn(k, n) for _ in range(layers) for k, n in shapes]
    xs = {k: torch.randn(rows, k) for k in (h, i)}
    flops = sum(2 * rows * w.shape[0] * w.shape[1] for w in weights)
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 5:
        t0 = time.perf_counter()
        for w in weights:
            xs[w.shape[0]] @ w
        times.append(time.perf_counter() - t0)
    return flops / min(times)  # the fastest pass, as gemm_rate


def copy_rate(mib: int = 512, seconds: float = 1.0) -> float:
    """Measured bytes/s of ``c = a + b`` over ``mib`` MiB tensors (two reads and a write per element, far larger
    than the caches): the rate an elementwise pass over a model's parameters can reach (the fastest of repeats)."""
    a, b = torch.randn(mib << 18), torch.randn(mib << 18)
    c = torch.empty_like(a)
    torch.add(a, b, out=c)
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 5:
        t0 = time.perf_counter()
        torch.add(a, b, out=c)
        times.append(time.perf_counter() - t0)
    return 3 * a.numel() * 4 / min(times)


class PartTimer:
    """Seconds spent in each timed part of the update, per step: the trainer's ``micro_loss`` (the policy's forward
    and the loss), ``Tensor.backward``, the gradient clip, the optimizer's and the anchor's ``step``."""

    def __init__(self, tr):
        import emapg.run.trainer as trainer_module

        self.seconds: dict[str, float] = {}
        tr.micro_loss = self._timed("forward + loss", tr.micro_loss)
        tr.run.optimizer.step = self._timed("AdamW step", tr.run.optimizer.step)
        tr.run.anchor.step = self._timed("EMA update", tr.run.anchor.step)
        dist = trainer_module.distributed
        self._undo = [(torch.Tensor, "backward", torch.Tensor.backward),
                      (dist, "clip_grad_norm", dist.clip_grad_norm)]
        torch.Tensor.backward = self._timed("backward", torch.Tensor.backward)
        dist.clip_grad_norm = self._timed("gradient clip", dist.clip_grad_norm)

    def _timed(self, part: str, fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] = self.seconds.get(part, 0.0) + time.perf_counter() - t0
        return run

    def take(self) -> dict[str, float]:
        out, self.seconds = self.seconds, {}
        return out

    def close(self) -> None:
        for owner, name, fn in self._undo:
            setattr(owner, name, fn)


def update_parts(params: int, parts: list[dict[str, float]], updates: list[float], fwd: dict[str, float],
                 rates: dict[str, float], bandwidth: float) -> dict[str, dict[str, float]]:
    """Each part's median seconds beside its floor: the forward's FLOPs (``fwd``, with its head) and the backward's
    (twice those) at ``rates``; AdamW (reads parameter, gradient and both moments, writes three: 28 bytes per fp32
    parameter), the clip (reads the gradients twice, writes them: 12) and the EMA (reads both copies, writes one:
    12) at ``bandwidth``; the rest is the update's time outside them."""
    flops = sum(fwd[k] / rates[k] for k in fwd)
    floors = {"forward + loss": flops, "backward": 2 * flops, "gradient clip": 12 * params / bandwidth,
              "AdamW step": 28 * params / bandwidth, "EMA update": 12 * params / bandwidth}
    med = {p: statistics.median(s.get(p, 0.0) for s in parts) for p in floors}
    med["rest"] = statistics.median(u - sum(s.values()) for u, s in zip(updates, parts, strict=True))
    return {p: {"measured_s": med[p], "floor_s": floors.get(p, 0.0),
                "ratio": med[p] / floors[p] if floors.get(p) else None} for p in med}


def layer_flops(cfg, tokens: int, context: float) -> float:
    """A forward of ``tokens`` tokens through every layer, each attending over ``context`` positions on average:
    the projections and MLP (2 x weights x tokens) and attention's two products."""
    h, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = h // heads
    weights = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 3 * h * i
    return layers * (2 * weights * tokens + 2 * 2 * heads * hd * tokens * context)


def phase_rates(cfg, rows: int, tokens: int, streamed: bool = False) -> dict[str, float]:
    """GEMM rates at a phase's shapes: the layers' at ``tokens`` rows (the MLP's up projection, in cache; or with
    ``streamed``, every layer's weights in turn from memory, as a decoding step reads them), the head's at
    ``rows`` (its [hidden, vocabulary] matrix is larger than the caches either way)."""
    layers = streamed_rate(cfg, tokens) if streamed else gemm_rate(tokens, cfg.hidden_size, cfg.intermediate_size)
    return {"layers": layers, "head": gemm_rate(rows, cfg.hidden_size, cfg.vocab_size)}


def step_floor(cfg, prompt_len: float, resp_len: float) -> dict[str, dict[str, float]]:
    """Each phase's FLOPs (layers, head) for one step of PROMPTS x SAMPLES rows."""
    rows, head = PROMPTS * SAMPLES, 2 * cfg.hidden_size * cfg.vocab_size
    resp_tokens = rows * resp_len
    gen = {"layers": layer_flops(cfg, PROMPTS * prompt_len, prompt_len / 2)  # each prompt's prefill, once
           + layer_flops(cfg, resp_tokens, prompt_len + resp_len / 2),       # a token per row per step
           "head": head * (resp_tokens + PROMPTS)}
    fwd = {"layers": layer_flops(cfg, PROMPTS * prompt_len, prompt_len / 2)
           + layer_flops(cfg, resp_tokens, prompt_len + resp_len / 2), "head": head * resp_tokens}
    return {"generation": gen, "anchor": fwd, "update": {k: 3 * v for k, v in fwd.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="write the measurements as JSON here")
    args = ap.parse_args()
    from emapg.config import load_config
    from emapg.run.trainer import Trainer

    torch.set_num_threads(args.threads)
    cfg = load_config(None, ["model=smollm2-135m", "task=arithmetic", f"steps={args.steps}", "seed=0",
                             f"prompts_per_step={PROMPTS}", f"micro_batch_prompts={PROMPTS}", "lr=1e-5",
                             f"threads={args.threads}", "eval.size=0", "export=false", f"rollout.n={SAMPLES}",
                             f"rollout.max_new_tokens={MAX_NEW}", "algo.beta=0.001", "algo.eta=0.9",
                             "algo.kl=topk_reverse", "algo.k=32"])
    rows, prompt_lens = [], []
    with tempfile.TemporaryDirectory() as out:
        tr = Trainer(cfg, out, progress=False)
        real = tr.rollout

        def counted(step):
            batch = real(step)
            prompt_lens.append(float(batch.prompt_mask.sum()) / batch.prompt_mask.shape[0])
            return batch

        tr.rollout = counted
        timer = PartTimer(tr)
        rows, timed = [], []
        for s in range(1, args.steps + 1):
            rows.append(tr.train_step(s))
            timed.append(timer.take())
        timer.close()
        model_cfg, params = tr.run.model.config, sum(p.numel() for p in tr.run.model.parameters())
    measured = {"generation": [r["gen_seconds"] for r in rows[1:]], "anchor": [r["anchor_seconds"] for r in rows[1:]],
                "update": [r["step_seconds"] - r["gen_seconds"] - r["anchor_seconds"] for r in rows[1:]],
                "step": [r["step_seconds"] for r in rows[1:]]}
    prompt_len, resp_len = statistics.median(prompt_lens[1:]), statistics.median(r["response_length"] for r in rows[1:])
    flops = step_floor(model_cfg, prompt_len, resp_len)
    rows_n, pass_tokens = PROMPTS * SAMPLES, int(PROMPTS * prompt_len + PROMPTS * SAMPLES * resp_len)
    rates = {"generation": phase_rates(model_cfg, rows_n, rows_n), "anchor": phase_rates(model_cfg, pass_tokens,
                                                                                          int(rows_n * resp_len))}
    rates["update"] = rates["anchor"]
    # a decoding step's products are 32 rows wide: each reads its weights from memory once per token (the passes,
    # hundreds of rows wide, reuse them from cache), so generation gets a second floor at the streamed rate
    streamed = {"generation": phase_rates(model_cfg, rows_n, rows_n, streamed=True)}
    table = {}
    for phase, parts in flops.items():
        floor = sum(parts[k] / rates[phase][k] for k in parts)
        floor_streamed = sum(parts[k] / streamed.get(phase, rates[phase])[k] for k in parts)
        seconds = statistics.median(measured[phase])
        table[phase] = {"gflops": sum(parts.values()) / 1e9, "floor_s": floor, "measured_s": seconds,
                        "ratio": seconds / floor, "rate_gflops": {k: v / 1e9 for k, v in rates[phase].items()},
                        "floor_streamed_s": floor_streamed, "ratio_streamed": seconds / floor_streamed,
                        "rate_streamed_gflops": {k: v / 1e9 for k, v in streamed.get(phase, rates[phase]).items()}}
    by_part = update_parts(params, timed[1:], measured["update"], flops["anchor"], rates["update"], copy_rate())
    total_floor = sum(t["floor_s"] for t in table.values())
    total_streamed = sum(t["floor_streamed_s"] for t in table.values())
    step = statistics.median(measured["step"])
    table["step"] = {"gflops": sum(t["gflops"] for t in table.values()), "floor_s": total_floor, "measured_s": step,
                     "ratio": step / total_floor, "floor_streamed_s": total_streamed,
                     "ratio_streamed": step / total_streamed}
    print(f"prompt {prompt_len:.0f} tokens, response {resp_len:.1f} tokens (medians over steps 2..{args.steps})\n")
    print("| phase | GFLOPs | GEMM rate, layers / head, GFLOP/s: in cache; streamed | floor s: in cache; streamed | "
          "measured s | measured / floor: in cache; streamed |")
    print("|---|---|---|---|---|---|")
    for phase, t in table.items():
        rate = "; ".join(" / ".join(f"{v:.0f}" for v in t[key].values())
                         for key in ("rate_gflops", "rate_streamed_gflops")) if "rate_gflops" in t else ""
        print(f"| {phase} | {t['gflops']:.1f} | {rate} | {t['floor_s']:.2f}; {t['floor_streamed_s']:.2f} | "
              f"{t['measured_s']:.2f} | {t['ratio']:.1f}x; {t['ratio_streamed']:.1f}x |")
    print("\nThe update, by part (medians over the same steps; products' floors at the update's GEMM rates, the rest "
          "at this machine's copy bandwidth):\n")
    print("| part | measured s | floor s | measured / floor |")
    print("|---|---|---|---|")
    for part, t in by_part.items():
        ratio = f"{t['ratio']:.1f}x" if t["ratio"] else ""
        print(f"| {part} | {t['measured_s']:.2f} | {t['floor_s']:.2f} | {ratio} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine(), "commit": commit(), "steps": args.steps,
                                              "prompt_tokens": prompt_len, "response_tokens": resp_len,
                                              "phases": table, "update_parts": by_part}, indent=1) + "\n")


if __name__ == "__main__":
    main()
