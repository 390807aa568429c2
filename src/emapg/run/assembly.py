"""A training run, assembled: everything :class:`emapg.run.trainer.Trainer` steps, built once, in order,
before the first step. The policy and its tokenizer, the task, its prompts fitted to the context, the
memory plan checked (on a GPU), the held-out evaluator, the checkpoint the run starts from (its own newest
intact one on resume, or another run's with ``init_from``), the distillation teacher, the EMA anchor (and
the frozen initial policy for ``kl_to_init``, and a weight EMA kept for shipping), AdamW and its schedule, the
vLLM engine, the restored state, config.yaml and the metrics writer. Under torchrun every process builds its own
share (the models sharded with FSDP2). Nothing here runs a step. How every step is cut and which passes it runs
(:class:`StepPlan`) is settled here once; the step reads it and derives none of it from the config again. So is
the learning rate's schedule (:func:`lr_factor`: a warmup by optimizer steps, or verl's by training steps) and a
checkpoint's schedule restored at the config's rate."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import os
import secrets
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from emapg import algo
from emapg.anchor import EMAAnchor
from emapg.backends import BACKENDS
from emapg.config import ConfigError, TrainConfig, check_world, mini_batch_prompts, recomputes_old, save_config
from emapg.models import distributed, plan
from emapg.models.forward import SHARD_METHODS
from emapg.models.lm import tied_names
from emapg.models.zoo import policy_model, teacher_model, training_policy, weights_digest
from emapg.rollout import DecodeLoop, response_budget
from emapg.rollout.prompts import context_length, fit_prompts
from emapg.rollout.sampling import SamplingSpec
from emapg.run.checkpoint import (
    CheckpointError,
    Progress,
    intact_checkpoint,
    restore_training,
    starting_checkpoint,
)
from emapg.run.evaluate import RunEvaluator
from emapg.run.folder import check_teacher
from emapg.run.metrics import MetricsWriter
from emapg.tasks import make_task
from emapg.tasks.base import Task, check_order


@dataclass(frozen=True)
class StepPlan:
    """world: processes. mini_prompts: prompts per optimizer step, over all processes; rank_mini_prompts: this
    process's share of them. micro_prompts / micro_tokens: how a mini-batch is cut (by prompts, or packed by
    tokens when micro_tokens > 0: :func:`step_micro_batches`). optimizer_steps: per training step (PPO epochs x
    mini-batches). recompute_old: pi_old is the trainer's own (another engine sampled, or asked); old_pass:
    pi_old needs a pass of its own (:func:`emapg.algo.needs_old_pass`). max_response: the most tokens a response
    can hold (an agent's whole episode), what seq-mean-token-sum-norm divides by."""

    world: int
    mini_prompts: int
    rank_mini_prompts: int
    micro_prompts: int
    micro_tokens: int
    optimizer_steps: int
    recompute_old: bool
    old_pass: bool
    max_response: int


@dataclass(kw_only=True)
class Run:
    """A run, built: what every step uses. ``plan`` says how every step is cut and which passes it runs (pi_old's,
    which then gives the sampler's head too); ``head`` and ``sampling`` are the estimator's head and the rollout's
    spec; ``teacher`` (None: the KL is to the anchor) and the sha256 of its weights; ``init_anchor``, the frozen
    initial policy where kl_to_init needs its own; ``plain_model`` makes an unsharded model for rank 0's export;
    ``engine``, the rollout backend's (the decode loop's for hf); ``metrics``, rank 0's writer (None elsewhere);
    ``progress``, where the run stands (a checkpoint keeps it); ``start_step``, the step a new run starts at (None
    on a resume)."""

    cfg: TrainConfig
    run_dir: Path
    show_progress: bool
    dist: distributed.DistInfo
    plan: StepPlan
    head: algo.KLHead
    sampling: SamplingSpec
    model: torch.nn.Module
    tokenizer: Any
    task: Task
    evaluator: RunEvaluator
    teacher: torch.nn.Module | None
    teacher_sha256: str | None
    anchor: EMAAnchor
    init_anchor: EMAAnchor | None
    anchor_is_initial: bool
    weight_ema: EMAAnchor | None
    plain_model: Callable[[], torch.nn.Module]
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    engine: Any
    metrics: MetricsWriter | None
    progress: Progress
    start_step: int | None

    @property
    def ema(self) -> EMAAnchor | None:
        """The weight EMA a user may ship (``weight_ema``): its own copy beside a frozen anchor, the anchor itself
        with EMA-PG; None without one."""
        if self.weight_ema is not None:
            return self.weight_ema
        return self.anchor if self.cfg.weight_ema is not None else None

    @property
    def main(self) -> bool:
        """Rank 0: it writes the run folder; the others only read it."""
        return self.dist.is_main


def assemble(cfg: TrainConfig, run_dir: Path, resume: bool, progress: bool, force: bool) -> Run:
    """Build the :class:`Run` of ``cfg`` in ``run_dir`` (resumed from its newest intact checkpoint with ``resume``;
    ``progress``: progress bars on rank 0; ``force``: accept a changed teacher on resume)."""
    dist = distributed.init(cfg.device, threads=cfg.threads)
    cfg = concrete_precision(cfg, dist)
    check_world(cfg, dist.world)
    if dist.is_main:  # (rank 0 writes the folder; the others only read it)
        run_dir.mkdir(parents=True, exist_ok=True)
    check_shared_folder(run_dir, dist)
    torch.manual_seed(cfg.seed)
    with distributed.rank_zero_first(dist):  # rank 0 fills the caches (a converted model, an index)
        model, tokenizer = training_policy(cfg, dist.device)
        task = make_task(cfg.task, **cfg.task_args)
        plan = step_plan(cfg, dist.world, task)  # how every step is cut and which passes it runs
        head = algo.kl_head(cfg.algo)  # the estimator's head and the rollout's sampling spec, read once
        sampling = algo.rollout_sampling(cfg.rollout, head, plan.old_pass)
        evaluator = checked_task(cfg, model, tokenizer, task, dist, run_dir, progress)
    tied = tied_names(model)  # before sharding: plain names and whole shapes
    state = model.state_dict()
    names = {n: list(t.shape) for n, t in state.items() if n not in tied}
    ckpt = checkpoint_to_start(run_dir, cfg, names, resume, warn=dist.is_main, known=set(state))
    since_start = ckpt["state"].get("anchor_is_initial", False) if ckpt else True
    teacher, teacher_sha256 = build_teacher(model, tokenizer, cfg, dist, run_dir, ckpt, force)
    if teacher is not None:
        evaluator.use_teacher(teacher, cfg.rollout.temperature)
    anchor, init_anchor, anchor_is_initial, weight_ema = build_anchors(model, cfg, dist, since_start)
    params = [p for p in model.parameters() if p.requires_grad]
    now = Progress()
    optimizer, scheduler = make_optimizer(params, cfg, lambda: now.step)
    engine = build_engine(cfg, model, tokenizer, task, sampling, dist, run_dir)
    if ckpt:
        st = restore_training(ckpt, model, anchor, optimizer, cfg, sharded=dist.enabled, weight_ema=weight_ema,
                              warn=dist.is_main)
        now.restore(st, resume)
        restore_schedule(scheduler, st["scheduler"], cfg.lr)
        evaluator.forget_after(now.step)
    if dist.is_main and not resume:
        save_config(cfg, run_dir / "config.yaml")
    metrics = MetricsWriter(run_dir, resume_step=now.step if resume else None, report_to=tuple(cfg.report_to),
                            config=dataclasses.asdict(cfg), wandb_project=cfg.wandb_project) if dist.is_main else None
    return Run(cfg=cfg, run_dir=run_dir, show_progress=progress, dist=dist, plan=plan, head=head, sampling=sampling,
               model=model, tokenizer=tokenizer, task=task, evaluator=evaluator, teacher=teacher,
               teacher_sha256=teacher_sha256, anchor=anchor, init_anchor=init_anchor,
               anchor_is_initial=anchor_is_initial, weight_ema=weight_ema, plain_model=lambda: policy_model(cfg)[0],
               params=params, optimizer=optimizer, scheduler=scheduler, engine=engine, metrics=metrics, progress=now,
               start_step=None if resume else now.step)


def checked_task(cfg: TrainConfig, model: torch.nn.Module, tokenizer, task: Task, dist: distributed.DistInfo,
                 run_dir: Path, progress: bool) -> RunEvaluator:
    """Before the first step: the data order checked, every prompt fitted to the context (refused or cut, never
    run for minutes), the memory plan checked; then the held-out evaluator, which fits its prompts alike."""
    check_order(task, cfg.data_order, cfg.prompts_per_step)
    budget = max(response_budget(task, cfg.rollout.max_new_tokens), cfg.eval.max_new_tokens or 0)
    fit = lambda t: fit_prompts(t, tokenizer, context_length(model), budget,  # noqa: E731
                                cfg.long_prompts, warn=dist.is_main)
    fit(task)
    check_memory(cfg, model, tokenizer, task, dist)
    return RunEvaluator(cfg, task, tokenizer, run_dir, dist, progress, fit)


def concrete_precision(cfg: TrainConfig, dist: distributed.DistInfo) -> TrainConfig:
    """``mixed_precision: auto`` made bf16 or fp32 for this run's device (said on rank 0); config.yaml then records
    the choice, so a resume keeps it."""
    precision, said = distributed.resolve_precision(cfg.mixed_precision, dist.device)
    if said and dist.is_main:
        print(f"emapg: {said}", file=sys.stderr)
    return dataclasses.replace(cfg, mixed_precision=precision)


def check_shared_folder(run_dir: Path, dist: distributed.DistInfo) -> None:
    """Every rank sees the run folder rank 0 writes (a checkpoint's files are written by every rank in place,
    and read back by each): rank 0 leaves a token there, each rank reads it. Several nodes need the run folder
    on a filesystem they share; a rank that cannot see it is named, with its host, on every rank."""
    if not dist.enabled:
        return

    probe = run_dir / ".emapg-ranks"
    token = secrets.token_hex(8) if dist.is_main else None
    if dist.is_main:
        probe.write_text(token)
    token = distributed.all_gather_objects(token)[0]
    try:
        seen = probe.read_text() == token
    except OSError:
        seen = False
    views = distributed.all_gather_objects((dist.rank, socket.gethostname(), seen))
    if dist.is_main:
        probe.unlink(missing_ok=True)
    blind = [f"rank {r} on {host}" for r, host, ok in views if not ok]
    if blind:
        raise ConfigError(f"--out {run_dir}: {', '.join(blind)} cannot see the run folder that rank 0 writes; with "
                          "several nodes the run folder must be on a filesystem every node shares (docs/USAGE.md, "
                          "'Several nodes')")


def check_memory(cfg: TrainConfig, model: torch.nn.Module, tokenizer, task, dist: distributed.DistInfo) -> None:
    """With ``memory_check``: refuse, before anything else is built, a run whose memory plan does not fit the
    device (a GPU), or on the CPU the host's whole memory shared by its processes (a run that could not fit even
    there, rather than one killed for memory after minutes), naming the settings to change
    (:mod:`emapg.models.plan`)."""
    capacity = device_capacity(dist.device)
    if capacity is None or not cfg.memory_check:
        return

    p = plan.run_plan(cfg, model.config, task, tokenizer, world=dist.world, device=dist.device.type,
                      gpu_memory=capacity)
    reason = plan.too_big(p, capacity, cfg)
    if reason:
        raise ConfigError(reason)


def device_capacity(device: torch.device) -> float | None:
    """Bytes of memory on a CUDA device; on the CPU the host's total memory over the processes on this host
    (LOCAL_WORLD_SIZE); None where neither is known."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return host_share(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def host_share(processes: int) -> float | None:
    """Bytes of this host's memory for each of ``processes`` processes on it (None where it is not known)."""
    total = host_memory()
    return None if total is None else total / processes


def host_memory() -> float | None:
    """The host's total memory in bytes (Linux: /proc/meminfo's MemTotal), or None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def build_teacher(model: torch.nn.Module, tokenizer, cfg: TrainConfig, dist: distributed.DistInfo,
                  run_dir: Path, ckpt: dict[str, Any] | None, force: bool) -> tuple[torch.nn.Module | None, str | None]:
    """``algo.teacher`` (on-policy distillation), frozen, sharded like an anchor's copy under torchrun, and
    the sha256 of its weights (checked on resume against the checkpoint's ``ckpt``); (None, None) without
    one. Loaded before the policy is sharded (its vocabulary is checked against it)."""
    if cfg.algo.teacher is None:
        return None, None
    with distributed.rank_zero_first(dist):  # rank 0 fills the caches (a converted built-in model)
        teacher = teacher_model(cfg, model, tokenizer, dist.device)
    digest = weights_digest(teacher)
    if ckpt is not None:
        check_teacher(run_dir, cfg.algo.teacher, ckpt["state"].get("teacher_sha256"), digest, force, dist.is_main)
    if dist.enabled:
        distributed.shard(teacher, cfg.mixed_precision, methods=SHARD_METHODS, offload=cfg.offload)
    return teacher, digest


def build_engine(cfg: TrainConfig, model: torch.nn.Module, tokenizer, task, sampling, dist: distributed.DistInfo,
                 run_dir: Path):
    """The run's rollout engine (:mod:`emapg.rollout`): emapg's decode loop over the policy (``rollout.backend:
    hf``), or another backend's (:mod:`emapg.backends`: vllm, or a user's own), this process's, sized for its share
    of a step's responses, its files in ``RUN/<backend>/``."""
    backend = BACKENDS[cfg.rollout.backend]
    open_engine = backend.builder("for_run")
    if open_engine is None:  # the hf backend
        return DecodeLoop(tokenizer, prefix_sharing=cfg.prefix_sharing, reuse_cache=cfg.rollout.agent_cache,
                          max_rows=cfg.rollout.max_rows,
                          autocast=lambda: distributed.autocast(cfg.mixed_precision, dist))
    return open_engine(cfg, model, tokenizer, task, sampling, rows=cfg.prompts_per_step // dist.world * sampling.n,
                       device=dist.device.type, rank=dist.rank, workdir=run_dir / backend.name)


def build_anchors(model: torch.nn.Module, cfg: TrainConfig, dist: distributed.DistInfo,
                  since_start: bool) -> tuple[EMAAnchor, EMAAnchor | None, bool, EMAAnchor | None]:
    """The EMA anchor, the frozen initial policy when kl_to_init needs its own (a full copy, or the
    initial adapters with LoRA), whether the anchor is the initial policy, and the weight EMA where it needs
    its own copy (``weight_ema`` beside a frozen anchor; with EMA-PG the anchor is it); the models sharded when
    ``dist`` is. Sharded, a full anchor's copy is made before sharding and sharded alike; LoRA needs none.

    eta = 1 since step 0 (``since_start``: a resumed run asks its checkpoint): the anchor is the initial
    policy, so it serves for kl_to_init too (and its final evaluation is the step-0 one). A run resumed
    with eta = 1 after steps at eta < 1 has an anchor that moved. With a teacher the KL's reference pass
    is the teacher's, so kl_to_init gets a pass of its own, on the anchor itself when it is the initial policy."""
    full = cfg.lora.r == 0 and dist.enabled
    anchor_copy = frozen_copy(model) if full else None
    anchor_is_initial = cfg.algo.eta == 1.0 and since_start
    own_init = cfg.log_kl_to_init and not anchor_is_initial
    init_copy = frozen_copy(model) if full and own_init else None
    own_ema = cfg.weight_ema is not None and cfg.algo.eta == 1.0
    ema_copy = frozen_copy(model) if full and own_ema else None
    if dist.enabled:
        for m in (model, anchor_copy, init_copy, ema_copy):
            if m is not None:
                distributed.shard(m, cfg.mixed_precision, methods=SHARD_METHODS, offload=cfg.offload)
    anchor = EMAAnchor(model, eta=cfg.algo.eta, every=cfg.algo.ema_every, module=anchor_copy)
    init_anchor = EMAAnchor(model, eta=1.0, module=init_copy) if own_init else None
    if cfg.log_kl_to_init and anchor_is_initial and cfg.algo.teacher is not None:
        init_anchor = anchor  # no second copy of the initial weights
    weight_ema = EMAAnchor(model, eta=cfg.weight_ema, module=ema_copy) if own_ema else None
    return anchor, init_anchor, anchor_is_initial, weight_ema


def make_optimizer(params: list[torch.nn.Parameter], cfg: TrainConfig, steps_done: Callable[[], int] = lambda: 0):
    """AdamW over ``params`` and its schedule (:func:`lr_factor`); ``steps_done()``: training steps done."""
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=tuple(cfg.betas))
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(cfg, s, steps_done()))


def checkpoint_to_start(run_dir: Path, cfg: TrainConfig, names: dict[str, list[int]], resume: bool, warn: bool,
                        known: set[str] | None = None):
    """The checkpoint a run starts from: its own newest intact one (resume), or another run's (``init_from``:
    a new run that starts where that one stands), or None. ``names``: the tensors a checkpoint must hold, by
    shape; ``known``: every name of the model (a tied head's too)."""
    if resume:
        return intact_checkpoint(run_dir, names, warn=warn, known=known)
    if not cfg.init_from:
        return None
    theirs = _model_of(Path(cfg.init_from))
    other = theirs is not None and theirs != cfg.model  # its checkpoints may not fit: "damaged" only if one does
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held) if other else contextlib.nullcontext():
            found = starting_checkpoint(Path(cfg.init_from), names, cfg.steps, warn=warn, known=known)
    except CheckpointError as e:  # healthy checkpoints of another model do not fit: say so, not only "damaged"
        if not other:
            raise
        raise ConfigError(f"init_from: {cfg.init_from} is a run of another model ({theirs}, not {cfg.model}) whose "
                          f"checkpoints do not fit this one ({e})") from None
    sys.stderr.write(held.getvalue())  # one fitted: the newer ones it passed over were damaged, said now
    return found


def _model_of(run_dir: Path) -> str | None:
    """The ``model`` a run folder's config.yaml names, or None where it cannot be read."""
    try:
        model = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("model")
    except (OSError, yaml.YAMLError, UnicodeDecodeError, AttributeError):
        return None
    return model if isinstance(model, str) else None


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    m = copy.deepcopy(model)
    m.requires_grad_(False)
    return m


def step_plan(cfg: TrainConfig, world: int, task: Task) -> StepPlan:
    """The plan of ``cfg``'s steps on ``world`` processes (``check_world`` has accepted the split)."""
    mini = mini_batch_prompts(cfg)
    recompute = recomputes_old(cfg)
    return StepPlan(world=world, mini_prompts=mini, rank_mini_prompts=mini // world,
                    micro_prompts=cfg.micro_batch_prompts, micro_tokens=cfg.micro_batch_tokens,
                    optimizer_steps=cfg.algo.ppo_epochs * (cfg.prompts_per_step // mini), recompute_old=recompute,
                    old_pass=algo.needs_old_pass(cfg.algo, cfg.rollout.top_p, recompute),
                    max_response=response_budget(task, cfg.rollout.max_new_tokens))


def lr_factor(cfg: TrainConfig, optimizer_steps: int, steps_done: int) -> float:
    """The learning rate's multiplier for the next optimizer step, after ``optimizer_steps`` of them and
    ``steps_done`` whole training steps: ``warmup_steps`` counts optimizer steps; ``warmup_ratio`` counts
    training steps from 0, as verl's constant schedule with warmup does (lr 0 on the first step)."""
    if cfg.warmup_steps:
        return min(1.0, (optimizer_steps + 1) / cfg.warmup_steps)
    if cfg.warmup_ratio:
        return min(1.0, steps_done / max(1, int(cfg.warmup_ratio * cfg.steps)))
    return 1.0


def restore_schedule(scheduler, state: dict, lr: float) -> None:
    """A checkpoint's schedule (how far it went) at the config's learning rate (a later stage may change it)."""
    scheduler.load_state_dict(state)
    scheduler.base_lrs = [lr] * len(scheduler.base_lrs)
