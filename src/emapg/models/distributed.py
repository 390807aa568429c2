"""Data parallelism on PyTorch distributed: torchrun starts the processes, FSDP2 shards the models.

Everything here is a thin layer over ``torch.distributed``; with one process every function is
the identity (or the local computation), so the trainer has a single code path.

* :func:`init` joins the process group that torchrun describes in the environment (NCCL for CUDA
  tensors and gloo for CPU ones on a GPU machine, gloo on a CPU) and says which rank and device this
  process has. ``EMAPG_COLLECTIVE_TIMEOUT`` (seconds) bounds every collective: a rank left waiting fails
  with the collective named instead of hanging.
* :func:`shard` applies ``fully_shard`` to each decoder layer and to the model, and registers the
  methods it is given (``emapg.models.forward.SHARD_METHODS``: the log-prob pass) as FSDP forward methods,
  so the output head (used by the chunked log-prob code without calling its ``forward``) is gathered
  and its gradient reduce-scattered like any other parameter.
* :func:`gathered` holds every shard gathered for generation: ``generate`` then runs locally,
  with no collective per token, so ranks may decode different numbers of tokens.
* The rest gathers or reduces plain numbers, objects and state for metrics and checkpoints.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from emapg.errors import ConfigError, PeerStopped
from emapg.models.lm import decoder_and_head


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job: rank, number of processes, local rank, device."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(device: str, field: str = "device") -> torch.device:
    """``auto`` = CUDA when available, else CPU; a CUDA device asked where none is visible is a one-line
    error naming ``field`` (``device`` in a config, ``--device`` on the command line)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, but no GPU visible"
        use = "--device cpu" if field.startswith("--") else "device=cpu or auto"
        raise ConfigError(f"{field} {device}: no CUDA device is visible to torch {torch.__version__} ({build}); "
                          f"use {use}")
    return dev


def init(device: str = "auto", threads: int | None = None) -> DistInfo:
    """Join the process group torchrun set up (WORLD_SIZE > 1), or describe a single process.
    ``threads``: torch's CPU threads for the whole job (each of W processes on the CPU takes threads / W)."""
    dev = resolve_device(device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if threads:
        torch.set_num_threads(max(1, threads // world) if dev.type == "cpu" else threads)
    elif dev.type == "cuda" and world > 1:  # torchrun sets OMP_NUM_THREADS=1: an offloaded optimizer step
        # (AdamW over the fp32 shards, on the CPU) would use one core; each process takes its share of the host's
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    if world <= 1:
        return DistInfo(device=dev)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        seconds = os.environ.get("EMAPG_COLLECTIVE_TIMEOUT")
        timeout = {"timeout": datetime.timedelta(seconds=float(seconds))} if seconds else {}
        dist.init_process_group(backend(dev.type), **timeout)
    return DistInfo(rank=rank, world=world, local_rank=local_rank, device=dev)


def backend(device_type: str) -> str:
    """The process group's backend for a job on ``device_type``. On CUDA, NCCL carries CUDA tensors and gloo
    CPU ones: with ``offload: true`` the shards, their gradients, the gradient norm and the anchor's average
    live on the CPU, and an NCCL-only group refuses CPU tensors (pytorch#148532)."""
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def served(backend_spec: str) -> dict[str, str]:
    """Device type -> backend of a group made with ``backend_spec`` ("gloo": the CPU only; "nccl": CUDA only)."""
    if ":" not in backend_spec:
        return {"gloo": {"cpu": "gloo"}, "nccl": {"cuda": "nccl"}}.get(backend_spec, {})
    return dict(part.split(":") for part in backend_spec.split(","))


BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo's names for a CPU that computes bf16 natively


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux's /proc/cpuinfo; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith("flags") for f in line.partition(":")[2].split()}


KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")  # the flags that choose torch's CPU kernels


def cpu_model() -> str | None:
    """The CPU's model name (Linux's /proc/cpuinfo; None elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return next((line.partition(":")[2].strip() for line in text.splitlines() if line.startswith("model name")), None)


def native_bf16(device: torch.device) -> tuple[bool, str]:
    """Whether ``device`` computes bf16 natively, and why: a GPU that supports it, or a CPU with AMX-BF16 or
    AVX512-BF16 (elsewhere bf16 is emulated on the CPU and slower than fp32)."""
    if device.type == "cuda":
        ok = torch.cuda.is_bf16_supported()
        return ok, f"this GPU {'supports' if ok else 'does not support'} bf16"
    have = [f for f in BF16_CPU_FLAGS if f in cpu_flags()]
    if have:
        return True, f"this CPU has {have[0].upper().replace('_', '-')}"
    return False, "this CPU has neither AMX-BF16 nor AVX512-BF16: bf16 would be emulated, slower than fp32"


def resolve_precision(mixed_precision: str | None, device: torch.device) -> tuple[str | None, str | None]:
    """``mixed_precision: auto`` made concrete for ``device`` (bf16 where it is native, else fp32), with the
    line that says so; any other value as it is, with no line."""
    if mixed_precision != "auto":
        return mixed_precision, None
    ok, why = native_bf16(device)
    return ("bf16" if ok else None), f"mixed_precision auto: {'bf16' if ok else 'fp32'} ({why})"


def autocast(mixed_precision: str | None, info: DistInfo):
    """bf16 autocast for a single process; sharded, FSDP's mixed-precision policy does it (no context)."""
    if mixed_precision == "bf16" and not info.enabled:
        return torch.autocast(info.device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def shutdown() -> None:
    """Leave the process group together, then, with several processes, exit at once (the last call of
    a run). A rank that tears gloo down while another still works (rank 0 writing files after the
    last collective), or the interpreter's own teardown of gloo's threads, can abort a rank (seen as
    SIGABRT, "terminate called without an active exception")."""
    if dist.is_initialized():
        multi = dist.get_world_size() > 1
        dist.barrier()
        dist.destroy_process_group()
        if multi:  # gloo's threads can still abort the interpreter's teardown: leave without it
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


def is_sharded(model: nn.Module) -> bool:

    return isinstance(model, FSDPModule)


def shard(model: nn.Module, mixed_precision: str | None = None,
          methods: dict[str, Callable[..., Any]] | None = None, offload: bool = False) -> nn.Module:
    """FSDP2 over the default process group: each decoder layer is one unit, the rest (embeddings,
    final norm, output head) the root unit. Parameters become DTensors sharded along dim 0.

    mixed_precision: ``"bf16"`` computes in bfloat16 and reduces gradients in fp32 (params stay
    fp32 masters); None computes in the parameters' dtype.
    methods: name -> function(model, ...) to attach to the model and register as FSDP forward methods
    (each must return tensors, or a pytree of them, for FSDP to hook their backward).
    offload: the shards (parameters, and so their gradients and the optimizer's state) live in CPU memory;
    each unit is copied to the device for its forward and backward, and the optimizer steps on the CPU
    (FSDP2's ``CPUOffloadPolicy``; verl's param_offload and optimizer_offload).
    """
    mp = None
    if mixed_precision == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    elif mixed_precision is not None:
        raise ConfigError(f"mixed_precision: expected 'bf16' or None, got {mixed_precision!r}")
    kw = {"mp_policy": mp} if mp is not None else {}
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    decoder, _ = decoder_and_head(model)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ConfigError(f"cannot shard {type(decoder).__name__}: it has no .layers list of decoder blocks")
    for layer in layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    for name, fn in (methods or {}).items():
        setattr(model, name, types.MethodType(fn, model))
        register_fsdp_forward_method(model, name)
    return model


def reshard(model: nn.Module) -> None:
    """Free every gathered FSDP unit of ``model`` (no-op when not sharded)."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[nn.Module]:
    """Every FSDP unit of ``model`` gathered, and kept so across forward calls, for generation.

    Costs one full copy of the parameters while open (what a generation engine holds anyway).
    """
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        yield model
        return
    for u in units:
        u.unshard()
        u.set_reshard_after_forward(False)
    try:
        with torch.no_grad():
            yield model
    finally:
        for u in units:
            u.reshard()
            u.set_reshard_after_forward(True)


# ---- reductions --------------------------------------------------------------------------------


def world() -> int:
    """The number of processes in the job (1 without a process group)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def _multi() -> bool:
    """More than one process (a vLLM engine may have made a 1-process group on its own)."""
    return world() > 1


def all_reduce(values: list[float], op: str = "sum") -> list[float]:
    """Sum (or max) a list of numbers over ranks."""
    if not _multi() or not values:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    if "cpu" not in served(dist.get_backend()):
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.cpu().tolist()


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (a one-item list with one process)."""
    if not _multi():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if _multi():
        dist.barrier()


@contextlib.contextmanager
def rank_zero_first(info: DistInfo) -> Iterator[None]:
    """Rank 0 runs the block first (filling caches: a converted model, a generated index), the other
    ranks after it (reading them). Where rank 0's block fails (a data file it refuses), the others stop with
    one line that points at rank 0's message, instead of a traceback from the collective they waited in."""
    if not info.enabled:
        yield
        return
    if not info.is_main:
        if all_gather_objects(None)[0] is not None:
            raise PeerStopped(f"rank {info.rank} stops: rank 0 could not start the run (its error above)")
        yield
        return
    try:
        yield
    except BaseException as e:
        all_gather_objects(type(e).__name__)  # the others wait here: tell them, then fail as rank 0 does
        raise
    all_gather_objects(None)


def all_agree(flag: bool) -> bool:
    """True when ``flag`` holds on every rank: a vote before a branch that holds a collective (a
    backward), so that no rank skips what the others wait in."""
    if not _multi():
        return bool(flag)
    return all_reduce([float(bool(flag))])[0] == dist.get_world_size()


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """Clip the gradients' global norm to ``max_norm``; the norm before clipping, over every rank's
    shards (the norm of sharded gradients is a DTensor; its whole value is a collective)."""
    return float(whole(torch.nn.utils.clip_grad_norm_(params, max_norm)))


# ---- whole tensors from shards and back --------------------------------------------------------

def local(t: Tensor) -> Tensor:
    """The tensor this rank holds: the local shard of a DTensor, the tensor itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


def whole(t: Tensor) -> Tensor:
    """The full tensor of a DTensor (an all-gather: collective), the tensor itself otherwise."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_tensor(local: Tensor, like: Tensor) -> Tensor:
    """The whole tensor of which ``local`` is this rank's shard, sharded as ``like`` (a DTensor).
    Collective: every rank must call it. ``local`` itself when ``like`` is not a DTensor."""
    if not isinstance(like, DTensor):
        return local
    whole = DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                               shape=like.shape, stride=like.stride())
    return whole.full_tensor()


def as_dtensor(local: Tensor, like: Tensor) -> Tensor:
    """``local`` as this rank's shard of a DTensor laid out as ``like`` (no communication); ``local`` itself
    when ``like`` is not a DTensor."""
    if not isinstance(like, DTensor):
        return local
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def local_shard(full: Tensor, like: Tensor) -> Tensor:
    """This rank's shard of ``full``, sharded as ``like`` (no communication); ``full`` when not sharded."""
    if not isinstance(like, DTensor):
        return full
    return distribute_tensor(full.to(like.device), like.device_mesh, like.placements, src_data_rank=None).to_local()


def model_state(model: nn.Module) -> dict[str, Tensor]:
    """The whole state dict on CPU (rank 0 gets it; other ranks get {} when sharded). Collective."""
    if not is_sharded(model):
        return model.state_dict()

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_model_state(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Load a whole state dict (every rank passes it) into a plain or sharded model."""
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, whole: bool = True) -> dict[str, Any]:
    """The optimizer state keyed by parameter name: one format for any number of processes. ``whole``: whole
    tensors on CPU (rank 0 gets them when sharded; collective); else each rank's DTensor shards (no
    communication)."""
    full = whole and is_sharded(model)
    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=full, cpu_offload=full))


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                         sharded: bool = False) -> None:
    """Load :func:`optimizer_state`'s dict: whole tensors (every rank passes them), or (``sharded``) each
    rank's DTensor shards."""
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=not sharded))
