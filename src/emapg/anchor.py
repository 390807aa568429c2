"""The EMA anchor of EMA-PG (docs/METHOD.md section 2): theta_ema <- eta * theta_ema + (1 - eta) * theta.

The average is kept in fp32 whatever the policy's dtype (a bf16 average rounds away updates of
size (1 - eta) * theta). Two modes:

* ``full``: every parameter and floating buffer is averaged; the anchor runs as its own copy of
  the model (``anchor.module``), whose weights are refreshed from the fp32 average.
* ``lora``: the policy is a PEFT model whose base is frozen; only the trainable (adapter) tensors
  are averaged, and the anchor runs as the policy's own base with the averaged adapters swapped
  in (:meth:`EMAAnchor.use`). The anchor then costs adapter-sized memory, not a second model.

With FSDP2 every tensor is a DTensor; the update acts on each rank's local shard, no gather.
Only :meth:`EMAAnchor.state_dict` gathers (whole tensors, so a checkpoint fits any number of
processes). A sharded policy needs its anchor copy made before sharding and sharded alike: pass
it as ``module``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from emapg.models import distributed


def _averaged_tensors(model: nn.Module, lora: bool) -> dict[str, Tensor]:
    """Name -> tensor of what the EMA averages: trainable parameters (lora) or all floating state."""
    if lora:
        return {n: p for n, p in model.named_parameters() if p.requires_grad}
    out = {n: p for n, p in model.named_parameters()}
    out.update({n: b for n, b in model.named_buffers() if b.is_floating_point()})
    return out


class EMAAnchor:
    """Exponential moving average of a policy, used as the KL anchor.

    Args:
        model: the policy at initialisation (theta_0); the anchor starts equal to it.
        eta: decay in (0, 1]; eta = 1 is the classic frozen reference. Ranges are the caller's to check
            (emapg.config.RULES: the trainer's config and the TRL plug-in's arguments go through it).
        every: apply the update every ``every`` calls of :meth:`step` (training steps).
        mode: ``"full"``, ``"lora"``, or ``"auto"`` (lora if the model has frozen parameters and
            trainable ones named like PEFT adapters).
        module: full mode only: the anchor's own copy of ``model`` (default: a deep copy). Given
            when the policy is sharded: a copy made before sharding, sharded the same way.
    """

    def __init__(self, model: nn.Module, eta: float, every: int = 1, mode: str = "auto",
                 module: nn.Module | None = None):
        if mode == "auto":
            mode = "lora" if any("lora_" in n for n, _ in model.named_parameters()) else "full"
        if mode not in ("full", "lora"):
            raise ValueError(f"anchor mode must be 'full', 'lora' or 'auto', got {mode!r}")
        self.eta, self.every, self.mode = eta, every, mode
        self.num_steps = 0
        self.num_updates = 0
        src = _averaged_tensors(model, mode == "lora")
        if not src:
            raise ValueError("the model has no tensors to average (no trainable parameters in lora mode)")
        self.module: nn.Module | None = None
        if mode == "full":
            self.module = module if module is not None else copy.deepcopy(model)
            self.module.requires_grad_(False)
            self.module.eval()
            src = _averaged_tensors(self.module, False)
        self._like = src  # name -> the averaged tensor (a DTensor when sharded): its layout
        # The average in at least fp32, one local shard per rank. Where the anchor module's own
        # tensor already has that precision, it holds the average in place (no second copy).
        self.average: dict[str, Tensor] = {}
        for n, t in src.items():
            local = distributed.local(t).detach()
            precise = torch.promote_types(local.dtype, torch.float32)
            self.average[n] = local if local.dtype == precise and mode == "full" else local.to(precise).clone()

    @property
    def frozen(self) -> bool:
        return self.eta == 1.0

    @torch.no_grad()
    def step(self, model: nn.Module) -> bool:
        """Count one training step; apply the EMA update when due. Returns whether it updated."""
        self.num_steps += 1
        if self.num_steps % self.every != 0:
            return False
        self.update(model)
        return True

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """theta_ema <- eta * theta_ema + (1 - eta) * theta, now (ignores ``every``)."""
        self.num_updates += 1
        if self.frozen:
            return
        src = _averaged_tensors(model, self.mode == "lora")
        for name, avg in self.average.items():
            avg.lerp_(distributed.local(src[name]).detach().to(avg.dtype), 1.0 - self.eta)
        self._sync_module()

    @torch.no_grad()
    def reset_to(self, model: nn.Module) -> None:
        """Start the average over at ``model``'s weights (a weight EMA added to a run that had none)."""
        src = _averaged_tensors(model, self.mode == "lora")
        for name, avg in self.average.items():
            avg.copy_(distributed.local(src[name]).detach().to(avg.dtype))
        self._sync_module()

    @torch.no_grad()
    def _sync_module(self) -> None:
        if self.module is None:
            return
        for name, t in _averaged_tensors(self.module, False).items():
            local = distributed.local(t)
            if local.data_ptr() != self.average[name].data_ptr():
                local.copy_(self.average[name])

    @contextlib.contextmanager
    def use(self, policy: nn.Module) -> Iterator[nn.Module]:
        """A module that computes the anchor's outputs, for log-probs or evaluation.

        Full mode yields the anchor's own copy. LoRA mode swaps the averaged adapters into
        ``policy`` and restores the policy's adapters on exit, even on error.
        """
        if self.module is not None:
            yield self.module
            return
        params = _averaged_tensors(policy, True)
        saved = {n: distributed.local(p).detach().clone() for n, p in params.items()}
        try:
            with torch.no_grad():
                for n, p in params.items():
                    distributed.local(p).copy_(self.average[n])
            yield policy
        finally:
            with torch.no_grad():
                for n, p in params.items():
                    distributed.local(p).copy_(saved[n])

    def state_dict(self, gather: bool = True) -> dict[str, Tensor]:
        """The fp32 average plus step counters as 0-d tensors (safetensors-friendly). ``gather``: whole
        tensors (gathered from the shards: collective when sharded); else DTensors over each rank's shard,
        laid out as the averaged parameters (no communication)."""
        if gather:
            state = {f"average.{n}": distributed.full_tensor(t, self._like[n]) for n, t in self.average.items()}
        else:
            state = {f"average.{n}": distributed.as_dtensor(t, self._like[n]) for n, t in self.average.items()}
        state["num_steps"] = torch.tensor(self.num_steps)
        state["num_updates"] = torch.tensor(self.num_updates)
        return state

    def layout(self) -> dict[str, Tensor]:
        """State-dict name -> the tensor whose layout that entry follows (a DTensor when sharded)."""
        return {**{f"average.{n}": self._like[n] for n in self.average},
                "num_steps": torch.tensor(0), "num_updates": torch.tensor(0)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Tensor], local: bool = False) -> None:
        """Restore :meth:`state_dict` (whole tensors, each rank keeping its shard; ``local``: each rank's rows
        already); names must match."""
        names = {n[len("average.") :] for n in state if n.startswith("average.")}
        if names != set(self.average):
            missing, extra = set(self.average) - names, names - set(self.average)
            raise KeyError(f"anchor state mismatch: missing {sorted(missing)[:5]}, unexpected {sorted(extra)[:5]}")
        for n, avg in self.average.items():
            t = state[f"average.{n}"]
            avg.copy_(t if local else distributed.local_shard(t, self._like[n]))
        self.num_steps = int(state["num_steps"])
        self.num_updates = int(state["num_updates"])
        self._sync_module()
