"""Worker for tests/test_distributed.py: run with plain python (1 process) or torchrun (N processes).

    python tests/dist_worker.py update OUT [KEY=VALUE ...]   one update on a fixed global batch
    python tests/dist_worker.py train RUN STEPS [--resume]   train (or resume) to STEPS, saving every step
    python tests/dist_worker.py resave RUN                   resume RUN and save again, without training
    python tests/dist_worker.py ragged OUT [--no-agree]      sharded passes over rows whose lengths differ by rank

``update`` writes, from rank 0, OUT/result.safetensors (the gradients of the first optimizer step,
the parameters and the anchor after the update, and the weights the vLLM backend would push) and
OUT/row.json (the metrics row).
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.utils._python_dispatch import TorchDispatchMode

from emapg.config import load_config
from emapg.models import distributed
from emapg.objective import group_advantages
from emapg.rollout.sampling import RolloutBatch
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


class CollectiveDevices(TorchDispatchMode):
    """Records, for every collective op dispatched while active (c10d and functional collectives: FSDP2's
    all-gathers and reduce-scatters, DTensor's, ours), the device types of its tensors."""

    def __init__(self):
        super().__init__()
        self.seen: dict[str, set[str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.name())
        if name.startswith(("c10d::", "_c10d_functional::")):
            devices = {t.device.type for t in torch.utils._pytree.tree_leaves((args, kwargs or {}))
                       if isinstance(t, torch.Tensor)}
            self.seen.setdefault(name, set()).update(devices)
        return func(*args, **(kwargs or {}))


def cmd_update(out: Path, overrides: list[str]) -> None:
    cfg = load_config(ROOT / "recipes" / "smoke.yaml", BASE + overrides)
    tr = Trainer(cfg, out / "run", progress=False)
    rank, world = tr.run.dist.rank, tr.run.dist.world
    batch = fixed_batch()
    mine = rank_share(batch, rank_prompts(batch.num_prompts, tr.run.plan.mini_prompts, world, rank))
    grads: dict[str, torch.Tensor] = {}
    original_step = tr.run.optimizer.step

    def recording_step(*args, **kwargs):
        if not grads:
            for name, p in tr.run.model.named_parameters():
                if p.grad is not None:
                    grads[f"grad.{name}"] = distributed.full_tensor(p.grad.to_local() if hasattr(p.grad, "to_local")
                                                                    else p.grad, p).detach().clone()
        return original_step(*args, **kwargs)

    tr.run.optimizer.step = recording_step
    with CollectiveDevices() as collectives:  # the update, the checkpoint's gathers and the vLLM push
        row = tr.update(mine)
        params = {f"param.{k}": v.clone() for k, v in distributed.model_state(tr.run.model).items()}
        anchor = {f"anchor.{k}": v for k, v in tr.run.anchor.state_dict().items() if k.startswith("average.")}
        if tr.run.weight_ema is not None:  # a weight EMA of its own (beside a frozen anchor), sharded alike
            ema = tr.run.weight_ema.state_dict()
            anchor.update({f"ema.{k}": v for k, v in ema.items() if k.startswith("average.")})
        # what the vLLM backend would push: gathered from shards, LoRA merged (collective on every rank)
        pushed = {f"vllm.{k}": v.detach().clone() for k, v in policy_weights(tr.run.model)}
        distributed.clip_grad_norm(tr.run.params, 1.0)
    if tr.run.dist.is_main:
        save_file({**grads, **params, **anchor, **pushed}, out / "result.safetensors")
        (out / "row.json").write_text(json.dumps({k: v for k, v in row.items() if not k.endswith("_seconds")}))
        policies = {type(m._get_fsdp_state()._fsdp_param_group.offload_policy).__name__
                    for m in tr.run.model.modules()
                    if distributed.is_sharded(m) and m._get_fsdp_state()._fsdp_param_group}
        (out / "offload.json").write_text(json.dumps(sorted(policies)))
        backend = torch.distributed.get_backend() if world > 1 else "none"
        (out / "collectives.json").write_text(json.dumps(
            {"backend": backend, "ops": {k: sorted(v) for k, v in collectives.seen.items()}}))


def ragged_batches(rank: int, vocab: int = 259) -> list[RolloutBatch]:
    """Micro-batches of 2 prompts x 2 responses whose lengths make each rank want another plan: rank 0's
    first spans 1 to 150 tokens (4 length groups), rank 1's are alike (1 group); in the second rank 1's
    responses count no position (all masked, one column after trimming: a call with no inputs)."""
    g = torch.Generator().manual_seed(99 + rank)
    spans = {0: [[150, 120, 3, 1], [7, 5, 6, 2]], 1: [[5, 5, 4, 4], [0, 0, 0, 0]]}[rank]
    out = []
    for lengths in spans:
        width = max(1, max(lengths))
        prompt_ids = torch.randint(3, vocab, (2, 6 + rank), generator=g)
        response_ids = torch.randint(3, vocab, (4, width), generator=g)
        mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
        out.append(RolloutBatch(prompt_ids=prompt_ids, prompt_mask=torch.ones_like(prompt_ids),
                                response_ids=response_ids, response_mask=mask, samp_logp=torch.zeros((4, width)), n=2))
    return out


def cmd_ragged(out: Path, agree: bool) -> None:
    """Forward and backward of the log-prob pass through FSDP2 on ragged rows, with prefix sharing and
    checkpointing: rank 0 writes the gathered gradients and the log-probs of every rank, and the same
    computed by one unsharded model over all ranks' rows (the equality test_distributed checks)."""
    from emapg.models import forward
    from emapg.models.forward import SHARD_METHODS, model_logprobs, response_logprobs
    from emapg.models.lm import set_pass_mode
    from emapg.models.zoo import tiny_model

    if not agree:  # the unequal plan of before: each rank decides its own calls
        forward.distributed = types.SimpleNamespace(**{**vars(distributed), "world": lambda: 1})
    info = distributed.init("cpu")
    model, plain = tiny_model("qwen2", vocab_size=259), tiny_model("qwen2", vocab_size=259)
    for m in (model, plain):
        m.gradient_checkpointing_enable()
        set_pass_mode(m, grad=True, lora_dropout=False)
    distributed.shard(model, methods=SHARD_METHODS)
    logps = []
    for mb in ragged_batches(info.rank):
        st = model_logprobs(model, mb, k_self=0)
        (st.logp_tok.sum() * info.world).backward()  # FSDP averages gradients over ranks: the sum's gradient
        logps.append(st.logp_tok.detach())
    grads = {f"grad.{n}": distributed.whole(p.grad).detach().clone() for n, p in model.named_parameters()}
    every = distributed.all_gather_objects([t.tolist() for t in logps])
    if not info.is_main:
        return
    ref = {}
    for rank, got in enumerate(every):
        for i, mb in enumerate(ragged_batches(rank)):
            st = response_logprobs(plain, mb)
            st.logp_tok.sum().backward()
            ref[f"logp.{rank}.{i}"] = st.logp_tok.detach()
            torch.testing.assert_close(torch.tensor(got[i], dtype=torch.float32), ref[f"logp.{rank}.{i}"],
                                       rtol=1e-5, atol=1e-5)
    ref.update({f"grad.{n}": p.grad for n, p in plain.named_parameters()})
    save_file({k: v.contiguous() for k, v in grads.items()}, out / "sharded.safetensors")
    save_file({k: v.contiguous() for k, v in ref.items() if k.startswith("grad.")}, out / "plain.safetensors")
    (out / "plans.json").write_text(json.dumps({"logps": [len(x) for r in every for x in r]}))


def cmd_blind(base: Path) -> None:
    """Two "nodes" that do not share the run folder: each rank works in a folder of its own, and the run folder
    is the same relative path; each rank writes the error it got."""
    import os

    from emapg.config import ConfigError

    rank = int(os.environ.get("RANK", "0"))
    (base / f"node{rank}").mkdir(exist_ok=True)
    os.chdir(base / f"node{rank}")
    try:
        Trainer(load_config(ROOT / "recipes" / "smoke.yaml", BASE), Path("run"), progress=False)
    except ConfigError as e:
        (base / f"error{rank}.txt").write_text(str(e))


def main(argv: list[str]) -> None:
    torch.use_deterministic_algorithms(True)
    cmd = argv[0]
    if cmd == "update":
        cmd_update(Path(argv[1]), argv[2:])
    elif cmd == "train":
        run, steps, resume = Path(argv[1]), int(argv[2]), "--resume" in argv
        extra = [a for a in argv[3:] if a != "--resume"]  # overrides of a new run
        if resume:
            cfg = load_config(run / "config.yaml", [f"steps={steps}"])
        else:
            # 6 prompts a step: 1, 2 and 3 processes each hold whole shares
            cfg = load_config(ROOT / "recipes" / "smoke.yaml", BASE + [f"steps={steps}", "keep_checkpoints=5",
                                                                       "prompts_per_step=6", *extra])
        Trainer(cfg, run, resume=resume, progress=False).train()
    elif cmd == "blind":
        cmd_blind(Path(argv[1]))
    elif cmd == "ragged":
        cmd_ragged(Path(argv[1]), agree="--no-agree" not in argv)
    elif cmd == "resave":
        run = Path(argv[1])
        Trainer(load_config(run / "config.yaml"), run, resume=True, progress=False).save()
    else:
        raise SystemExit(f"unknown command {cmd}")
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
