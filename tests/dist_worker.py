"""Worker for tests/test_distributed.py: run with plain python (1 process) or torchrun (N processes).

    python tests/dist_worker.py update OUT [KEY=VALUE ...]   one update on a fixed global batch
    python tests/dist_worker.py train RUN STEPS [--resume]   train (or resume) to STEPS, saving every step
    python tests/dist_worker.py resave RUN                   resume RUN and save again, without training

``update`` writes, from rank 0, OUT/result.safetensors (the gradients of the first optimizer step,
the parameters and the anchor after the update, and the weights the vLLM backend would push) and
OUT/row.json (the metrics row).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from emapg.config import load_config
from emapg.models import distributed
from emapg.objective import group_advantages
from emapg.rollout.batch import RolloutBatch
from emapg.rollout.vllm_backend import policy_weights
from emapg.run.trainer import Trainer, rank_prompts

ROOT = Path(__file__).resolve().parents[1]
BASE = ["model=tiny-llama", "export=false", "eval.size=0", "prompts_per_step=4", "micro_batch_prompts=1",
        "rollout.n=2", "rollout.max_new_tokens=6", "algo.kl=topk_reverse", "algo.k=4", "algo.eta=0.5",
        "threads=1", "save_every=1", "lr=1e-3", "seed=3"]


def fixed_batch(vocab: int = 259, prompts: int = 4, n: int = 2, k: int = 4) -> RolloutBatch:
    """A global batch built from a seed alone: ragged prompts and responses, off-policy sampled
    log-probs (ratios away from 1, so clipping acts), distinct top-k ids, 0/1 rewards."""
    g = torch.Generator().manual_seed(1234)
    lp, lr, b = 7, 6, prompts * n
    prompt_ids = torch.randint(3, vocab, (prompts, lp), generator=g)
    prompt_mask = torch.ones_like(prompt_ids)
    for i, length in enumerate([7, 4, 5, 2]):
        prompt_mask[i, : lp - length] = 0
        prompt_ids[i, : lp - length] = 1
    response_ids = torch.randint(3, vocab, (b, lr), generator=g)
    lengths = torch.tensor([6, 3, 5, 1, 6, 2, 4, 6])
    response_mask = (torch.arange(lr)[None] < lengths[:, None]).long()
    response_ids = torch.where(response_mask.bool(), response_ids, torch.ones_like(response_ids))
    samp_logp = -torch.rand((b, lr), generator=g) * 2 - 4.5
    samp_topk = torch.rand((b, lr, vocab), generator=g).topk(k, -1).indices
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                        response_mask=response_mask * torch.ones_like(response_mask), samp_logp=samp_logp, n=n,
                        samp_topk=samp_topk, top_p_cut=torch.zeros((b, lr)), entropy=torch.rand((b, lr), generator=g),
                        truncated=lengths == lr, rewards=rewards, advantages=group_advantages(rewards, n, "grpo"))


def rank_share(batch: RolloutBatch, prompts: list[int]) -> RolloutBatch:
    """The rows of some prompts (not a contiguous run: a rank's share of every mini-batch)."""
    rows = torch.tensor([p * batch.n + j for p in prompts for j in range(batch.n)])
    pick = lambda t: None if t is None else t[rows]  # noqa: E731
    return RolloutBatch(prompt_ids=batch.prompt_ids[prompts], prompt_mask=batch.prompt_mask[prompts],
                        response_ids=pick(batch.response_ids), response_mask=pick(batch.response_mask),
                        samp_logp=pick(batch.samp_logp), n=batch.n, samp_topk=pick(batch.samp_topk),
                        top_p_cut=pick(batch.top_p_cut), entropy=pick(batch.entropy), truncated=pick(batch.truncated),
                        rewards=pick(batch.rewards), advantages=pick(batch.advantages))


def cmd_update(out: Path, overrides: list[str]) -> None:
    cfg = load_config(ROOT / "recipes" / "smoke.yaml", BASE + overrides)
    tr = Trainer(cfg, out / "run", progress=False)
    rank, world = tr.dist.rank, tr.dist.world
    batch = fixed_batch()
    mine = rank_share(batch, rank_prompts(batch.num_prompts, cfg.mini_batch_prompts or cfg.prompts_per_step,
                                          world, rank))
    grads: dict[str, torch.Tensor] = {}
    original_step = tr.optimizer.step

    def recording_step(*args, **kwargs):
        if not grads:
            for name, p in tr.model.named_parameters():
                if p.grad is not None:
                    grads[f"grad.{name}"] = distributed.full_tensor(p.grad.to_local() if hasattr(p.grad, "to_local")
                                                                    else p.grad, p).detach().clone()
        return original_step(*args, **kwargs)

    tr.optimizer.step = recording_step
    row = tr.update(mine)
    params = {f"param.{k}": v.clone() for k, v in distributed.model_state(tr.model).items()}
    anchor = {f"anchor.{k}": v for k, v in tr.anchor.state_dict().items() if k.startswith("average.")}
    # what the vLLM backend would push: gathered from shards, LoRA merged (collective on every rank)
    pushed = {f"vllm.{k}": v.detach().clone() for k, v in policy_weights(tr.model)}
    if tr.dist.is_main:
        save_file({**grads, **params, **anchor, **pushed}, out / "result.safetensors")
        (out / "row.json").write_text(json.dumps({k: v for k, v in row.items() if not k.endswith("_seconds")}))
        policies = {type(m._get_fsdp_state()._fsdp_param_group.offload_policy).__name__
                    for m in tr.model.modules() if distributed.is_sharded(m) and m._get_fsdp_state()._fsdp_param_group}
        (out / "offload.json").write_text(json.dumps(sorted(policies)))


def main(argv: list[str]) -> None:
    torch.use_deterministic_algorithms(True)
    cmd = argv[0]
    if cmd == "update":
        cmd_update(Path(argv[1]), argv[2:])
    elif cmd == "train":
        run, steps, resume = Path(argv[1]), int(argv[2]), "--resume" in argv
        if resume:
            cfg = load_config(run / "config.yaml", [f"steps={steps}"])
        else:
            cfg = load_config(ROOT / "recipes" / "smoke.yaml", BASE + [f"steps={steps}", "keep_checkpoints=5"])
        Trainer(cfg, run, resume=resume, progress=False).train()
    elif cmd == "resave":
        run = Path(argv[1])
        Trainer(load_config(run / "config.yaml"), run, resume=True, progress=False).save()
    else:
        raise SystemExit(f"unknown command {cmd}")
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
