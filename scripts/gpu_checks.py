"""The figures and comparisons of scripts/gpu_check.sh (the GPU acceptance run), one subcommand each:

    report RUN            median step time, generated tokens/s, peak GPU memory (reserved) of a run folder
    signal RUN            fails unless some step had a group with a learning signal (advantages not all 0)
    agree [DEVICE]        one micro-batch's loss in bf16 autocast against fp32, same rollout (SmolLM2-135M)
    same A B              fails unless two runs' last checkpoints hold the same policy and anchor
    plan RUN              the memory plan of a run's config against its measured peak (reserved): fails when the
                          measured peak exceeds the plan by more than 15% (a plan that says "fits" wrongly)

Each prints one line, the check's figure, and exits 1 when the check fails.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def rows(run: str) -> list[dict]:
    lines = (Path(run) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, filter(None, lines)) if "step_seconds" in r]


def report(run: str) -> int:
    rs = rows(run)
    if not rs:
        print("no training step recorded")
        return 1
    tok = statistics.median(r["response_length"] * r["responses"] / r["gen_seconds"] for r in rs)
    peak = max(r.get("peak_reserved_gb", float("nan")) for r in rs)
    tis = (f", TIS weight {statistics.fmean(r['tis_weight'] for r in rs):.4f} (capped "
           f"{statistics.fmean(r['tis_capped_frac'] for r in rs):.1e})" if "tis_weight" in rs[0] else "")
    print(f"{len(rs)} steps, median {statistics.median(r['step_seconds'] for r in rs):.1f} s/step, "
          f"{tok:.0f} tok/s, mean response {statistics.fmean(r['response_length'] for r in rs):.0f} tokens, "
          f"peak {peak:.1f} GiB reserved{tis}")
    return 0


def signal(run: str) -> int:
    rs = rows(run)
    best = min((r["no_signal_frac"] for r in rs), default=1.0)
    print(f"reward {statistics.fmean(r['reward_mean'] for r in rs):.2f}, groups without signal {best:.2f} at best")
    return 0 if best < 1.0 else 1


def agree(device: str = "cuda") -> int:
    import torch

    from emapg.config import load_config
    from emapg.run.trainer import Trainer

    base = ["model=smollm2-135m", f"device={device}", "export=false", "save_every=0", "eval.size=0",
            "task_args.digits=1", "rollout.max_new_tokens=16"]
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="emapg-agree-"))
    full = Trainer(load_config("recipes/smoke.yaml", base), tmp / "fp32", progress=False)
    mixed = Trainer(load_config("recipes/smoke.yaml", [*base, "mixed_precision=bf16"]), tmp / "bf16", progress=False)
    batch = full.rollout(1)
    mb = batch.micro_batches(full.run.cfg.micro_batch_prompts)[0]
    counts = {"num_tokens": float(mb.response_mask.sum()), "num_seqs": float(mb.response_mask.shape[0]),
              "max_len": 16}
    with torch.no_grad():
        a, _ = full.micro_loss(mb, full.anchor_pass(mb), counts)
        b, _ = mixed.micro_loss(mb, mixed.anchor_pass(mb), counts)
        gap = (full._logprobs(full.run.model, mb).logp_tok - mixed._logprobs(mixed.run.model, mb).logp_tok).abs()
    # bf16 keeps 8 bits of mantissa: log-probs agree to a few hundredths of a nat, a small loss less closely
    print(f"loss fp32 {float(a):.5f}, bf16 autocast {float(b):.5f}; sampled tokens' log-probs differ by "
          f"{float(gap.mean()):.4f} nats on average, {float(gap.max()):.3f} at most")
    return 0 if float(gap.mean()) < 0.05 and abs(float(a) - float(b)) < 0.1 * max(abs(float(a)), 0.1) else 1


def same(a: str, b: str) -> int:
    from emapg.run.checkpoint import latest_checkpoint, load_checkpoint

    x, y = load_checkpoint(latest_checkpoint(Path(a))), load_checkpoint(latest_checkpoint(Path(b)))
    worst = max(float((x[part][k].float() - y[part][k].float()).abs().max())
                for part in ("policy", "anchor") for k in x[part])
    same_step = x["state"]["step"] == y["state"]["step"]
    print(f"step {x['state']['step']} vs {y['state']['step']}, largest difference {worst:.1e}")
    return 0 if same_step and worst <= 1e-6 else 1


def plan(run: str) -> int:
    import torch

    from emapg.config import load_config
    from emapg.models import plan as P
    from emapg.models.zoo import load_model, load_tokenizer
    from emapg.tasks import make_task

    cfg = load_config(Path(run) / "config.yaml")
    task = make_task(cfg.task, **cfg.task_args)
    if Path(cfg.model).is_dir():
        tokenizer = load_tokenizer(cfg.model)
    else:  # a built-in name: its tokenizer, the model built on the meta device (nothing allocated)
        with torch.device("meta"):
            _, tokenizer = load_model(cfg.model)
    capacity = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    p = P.run_plan(cfg, P.model_config(cfg.model), task, tokenizer, gpu_memory=capacity)
    measured = max(r.get("peak_reserved_gb", float("nan")) for r in rows(run)) * 2**30
    print(f"planned {p.peak / 2**30:.1f} GiB ({p.peak_phase}), measured {measured / 2**30:.1f} GiB reserved: "
          f"measured / planned {measured / p.peak:.2f}")
    return 0 if measured <= 1.15 * p.peak else 1


def main(argv: list[str]) -> int:
    commands = {"report": report, "signal": signal, "agree": agree, "same": same, "plan": plan}
    if not argv or argv[0] not in commands:
        print(__doc__)
        return 2
    return commands[argv[0]](*argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
