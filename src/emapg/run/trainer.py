"""The EMA-PG training loop and step (docs/METHOD.md section 4), the file to read first. It only
orchestrates: every formula lives in kl.py, objective.py, logprobs.py and anchor.py; what the passes
gather is algo.py's; what a run is made of is built once by run/assembly.py; checkpoints are
run/checkpoint.py's and evaluation is run/evaluate.py's.

One step: prompts -> n responses -> rewards -> advantages -> anchor pass -> PPO epochs over
mini-batches (micro-batches accumulate) -> optimizer steps -> EMA anchor update -> metrics ->
checkpoint. Every step seeds its own randomness from (seed, step), so a resumed run replays
exactly what an uninterrupted one would.

Under torchrun every process runs this same loop on its share of the prompts (whole groups, so
rewards and advantages need no communication); emapg.models.distributed shards the models with FSDP2,
normalises the loss by global token counts and reduces the metrics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from emapg import algo
from emapg.algo import AnchorStats
from emapg.backends import BACKENDS
from emapg.config import TrainConfig
from emapg.models import distributed
from emapg.models.distributed import gathered
from emapg.models.forward import model_logprobs
from emapg.models.lm import set_pass_mode
from emapg.objective import group_advantages
from emapg.rollout.batch import RolloutBatch
from emapg.rollout.sampling import stream_seed
from emapg.run.assembly import Run, assemble
from emapg.run.checkpoint import save_training
from emapg.run.evaluate import RANK_SEED_STRIDE, RunEvaluator, eval_row
from emapg.run.export import export_models
from emapg.run.folder import mark_finished
from emapg.run.metrics import add_stats, peak_memory_row, rollout_row, update_row
from emapg.run.micro_batches import step_micro_batches
from emapg.run.schedule import schedule_step_lr
from emapg.tasks.order import training_prompts
from emapg.tasks.scoring import score_completions


def step_seed(seed: int, step: int) -> int:
    """The seed of step ``step`` of a run seeded ``seed``: its prompts and torch's draws (a resumed run
    replays them)."""
    return seed * 1_000_003 + step


def rank_prompts(prompts: int, mini: int, world: int, rank: int) -> list[int]:
    """The prompts of a global batch that rank ``rank`` holds: its share of every mini-batch, so an
    optimizer step sees the same prompts whatever the number of processes."""
    share = mini // world
    return [m + rank * share + i for m in range(0, prompts, mini) for i in range(share)]


def start_settings(evaluator: RunEvaluator, step: int) -> dict[str, Any]:
    """What the first evaluation of a run was measured with; at a step > 0 (a run started from another's
    checkpoint) it is not the initial policy's, which the settings then say (the anchor never reuses it)."""
    return {**evaluator.settings, **({"at_step": step} if step else {})}


class Trainer(Run):
    """A :class:`~emapg.run.assembly.Run` with its loop and its step. ``Trainer(cfg, run_dir)`` assembles the run
    (``resume=True``: from its latest checkpoint); ``Trainer.of(run)`` steps one already assembled."""

    def __init__(self, cfg: TrainConfig, run_dir: str | Path, resume: bool = False, progress: bool = True,
                 force: bool = False):
        self._take(assemble(cfg, Path(run_dir), resume=resume, progress=progress, force=force))

    @classmethod
    def of(cls, run: Run) -> Trainer:
        trainer = cls.__new__(cls)
        trainer._take(run)
        return trainer

    def _take(self, run: Run) -> None:
        """Become ``run``: its parts, field by field."""
        Run.__init__(self, **{f.name: getattr(run, f.name) for f in dataclasses.fields(Run)})

    # ---- the run, top down -------------------------------------------------------------------------

    def train(self) -> dict[str, Any] | None:
        """Run to ``cfg.steps``; the final eval table {'init'|'policy'|'anchor'[|'ema']: results} on rank 0, else
        None."""
        from tqdm.auto import tqdm

        cfg, now = self.cfg, self.progress
        if cfg.eval.at_start and self.evaluator.examples and now.step == self.start_step:  # not once it moved
            results = self._evaluate("policy")
            now.initial_eval, now.initial_eval_settings = results["heldout"], start_settings(self.evaluator, now.step)
            self._write({"step": now.step, **_rows("policy", results)})
        bar = tqdm(total=cfg.steps, initial=now.step, disable=not (self.show_progress and self.main), desc="emapg",
                   unit="step")
        while now.step < cfg.steps:
            step = now.step + 1
            row = self.train_step(step)
            now.step = step
            periodic = bool(self.evaluator.examples and cfg.eval.every and step % cfg.eval.every == 0)
            if self.evaluator.examples and (periodic or step == cfg.steps):
                row.update(self._evaluate_models(final=step == cfg.steps))
            self._write(row)
            if cfg.save_every and (step % cfg.save_every == 0 or step == cfg.steps):
                self.save()
            bar.set_postfix(reward=f"{row['reward_mean']:.2f}", kl_estimate=f"{row['kl']:.1e}",  # sampled: may be < 0
                            s=f"{row['step_seconds']:.1f}")
            bar.update(1)
        bar.close()
        if cfg.export:
            export_models(self.run_dir / "export", self.model, self.anchor, self.tokenizer,
                          sharded=self.dist.enabled, main=self.main, plain_model=self.plain_model,
                          weight_ema=self.weight_ema)
        if not self.main:
            return None
        table = self.metrics.finish(now.initial_eval)
        mark_finished(self.run_dir, now.step)  # a resume of a run whose end was cut short finishes it
        return table

    def train_step(self, step: int) -> dict[str, Any]:
        """Rollout, then :meth:`update`; the metrics row of the step."""
        torch.manual_seed(step_seed(self.cfg.seed, step) + RANK_SEED_STRIDE * self.dist.rank)
        t0 = time.perf_counter()
        batch = self.rollout(step)
        t_gen = time.perf_counter() - t0
        row = {"step": step, **self.update(batch), "gen_seconds": t_gen,
               "responses": self.cfg.prompts_per_step * self.cfg.rollout.n}
        row["step_seconds"] = time.perf_counter() - t0
        return {**row, **peak_memory_row(self.dist.device)}  # this rank's high-water mark of the step

    def rollout(self, step: int) -> RolloutBatch:
        """This rank's share of step ``step``'s prompts, sampled, scored, with group advantages."""
        cfg = self.cfg
        examples = training_prompts(self.task, cfg.data_order, cfg.seed, step, cfg.prompts_per_step,
                                    step_seed(cfg.seed, step))
        mine = rank_prompts(cfg.prompts_per_step, self.plan.mini_prompts, self.plan.world, self.dist.rank)
        examples = [examples[i] for i in mine]  # the global batch is the same on every rank
        self.engine.sync(self.model, version=self.progress.step)  # the weights after that many updates
        seed = stream_seed(cfg.seed, step, self.dist.rank)  # an engine's requests' (the decode loop: torch's, seeded)
        batch = self.engine.rollout(self.task, examples, self.sampling, seed=seed, device=self.dist.device)
        self.engine.after_rollout()
        batch.rewards = score_completions(self.task, batch.completions, examples, cfg.rollout.n,
                                          truncated=batch.truncated).to(self.dist.device)
        batch.advantages = group_advantages(batch.rewards, cfg.rollout.n, cfg.algo.advantage)
        return batch

    def update(self, batch: RolloutBatch) -> dict[str, Any]:
        """Learn from this rank's share of a scored rollout batch (its rollout metrics first, then with
        ``algo.mask_truncated`` truncated responses masked out of the loss): anchor pass, PPO epochs over
        mini-batches of micro-batches, optimizer steps, EMA update. Returns the metrics (global:
        reduced over ranks)."""
        cfg, a, plan = self.cfg, self.cfg.algo, self.plan
        t0 = time.perf_counter()
        sampled = rollout_row(batch, cfg.rollout.n)  # what was sampled: a truncated response's length counts
        if a.mask_truncated:  # ... but none of its tokens counts in the loss
            batch.response_mask = batch.response_mask * (~batch.truncated).long()[:, None]
        lr_used = schedule_step_lr(self.optimizer, self.scheduler)
        minis = step_micro_batches(batch, plan.rank_mini_prompts, plan.micro_prompts, plan.micro_tokens)
        anchors = [[self.anchor_pass(mb) for mb in mbs] for mbs in minis]
        t_anchor = time.perf_counter() - t0
        stats: dict[str, float] = {}
        grad_norms, skipped = [], 0
        for _epoch in range(a.ppo_epochs):
            for mbs, ancs in zip(minis, anchors, strict=True):
                done = self._optimizer_step(mbs, ancs)
                if done is None:  # a non-finite loss or gradient: this update is dropped, training goes on
                    skipped += 1
                    continue
                for part in done[0]:
                    add_stats(stats, part)
                grad_norms.append(done[1])
        self.optimizer.zero_grad(set_to_none=True)
        ema_updated = self.anchor.step(self.model)
        if self.weight_ema is not None:  # the weights' EMA kept for shipping, outside the loss
            self.weight_ema.step(self.model)
        self.progress.skipped_steps += skipped
        applied = plan.optimizer_steps - skipped
        return {**sampled, **update_row(stats, applied, grad_norms),
                "lr": lr_used, "ema_updated": int(ema_updated), "skipped_updates": skipped,
                "skipped_total": self.progress.skipped_steps, "anchor_seconds": t_anchor}

    @torch.no_grad()
    def anchor_pass(self, mb: RolloutBatch) -> AnchorStats:
        """The no-grad passes of a micro-batch: pi_old when it needs a pass (with its top-k, the sampler's head
        then); the KL's reference (the anchor, or the teacher) at the sampled tokens and at the head ids that
        :func:`emapg.algo.anchor_request` names; the initial policy for the kl_to_init diagnostic."""
        # pi_old's pass, where one is needed (decided once with the sampling spec), gives the sampler's head
        old = self._logprobs(self.model, mb, k_self=self.head.sampler_k) if self.plan.old_pass else None
        ids, k_self = algo.anchor_request(self.head, mb, self.model.get_output_embeddings().weight.shape[0],
                                          None if old is None else old.topk_ids)
        ref = self.anchor.use(self.model) if self.teacher is None else contextlib.nullcontext(self.teacher)
        with ref as ref_model:
            st = self._logprobs(ref_model, mb, ids=ids, k_self=k_self)
        old = None if old is None else old.logp_tok
        init = None
        if self.init_anchor is not None:
            with self.init_anchor.use(self.model) as init_model:
                init = self._logprobs(init_model, mb).logp_tok
        elif self.cfg.log_kl_to_init:  # the anchor is the initial policy (eta = 1 since step 0)
            init = st.logp_tok
        return algo.anchor_stats(self.head, st, ids, mb, old, init, self.cfg.algo, self.plan.recompute_old)

    def _optimizer_step(self, mbs: list[RolloutBatch],
                        anchors: list[AnchorStats]) -> tuple[list[dict[str, float]], float] | None:
        """One optimizer step on a mini-batch of micro-batches (gradients accumulate). Returns their
        statistics and the grad norm, or None when the update was dropped as non-finite."""
        world = self.dist.world
        local_tokens = float(sum(mb.response_mask.sum() for mb in mbs))
        counts = {"num_tokens": distributed.all_reduce([local_tokens])[0],
                  "num_seqs": float(self.plan.mini_prompts * self.cfg.rollout.n), "max_len": self.plan.max_response}
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

    def micro_loss(self, mb: RolloutBatch, anc: AnchorStats, counts: dict[str, Any]) -> tuple[Tensor, dict]:
        """The policy pass of one micro-batch, at the anchor's head ids, and :func:`emapg.algo.loss`."""
        return algo.loss(self._logprobs(self.model, mb, ids=anc.head_ids), anc, mb, self.cfg.algo, counts)

    def _drop_update(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        distributed.reshard(self.model)  # a skipped backward leaves units gathered

    def _logprobs(self, model: torch.nn.Module, mb: RolloutBatch, **kw) -> Any:
        set_pass_mode(model, grad=torch.is_grad_enabled(), lora_dropout=self.cfg.lora.dropout > 0)
        with self._autocast():
            return model_logprobs(model, mb, **kw, temperature=self.cfg.rollout.temperature,
                                  chunk_size=self.cfg.chunk_size, prefix_sharing=self.cfg.prefix_sharing)

    # ---- evaluation, checkpoints, shutdown ------------------------------------------------------------

    def evaluate(self, which: str = "policy") -> dict[str, Any]:
        """Held-out accuracy of the policy or the anchor (each rank evaluates its share; {} without a set)."""
        res = self._evaluate(which, sets=("heldout",)).get("heldout", {})
        return {k: v for k, v in res.items() if k != "solved"}  # the per-problem outcomes went to RUN/outcomes

    def _evaluate_models(self, final: bool) -> dict[str, Any]:
        """A periodic (or the ``final``) evaluation's metrics: the policy; the anchor (at the end, or every time
        with ``eval.anchor``); the weight EMA (``weight_ema``; with EMA-PG the anchor's results, not run twice).
        The validation set is the policy's and the EMA's: the choice of the model to ship."""
        row = _rows("policy", self._evaluate("policy"))
        anchor_res = None
        if final or self.cfg.eval.anchor:
            sets = ("heldout", "validation", "transfer") if self.ema is self.anchor else ("heldout", "transfer")
            anchor_res = self._evaluate("anchor", sets=sets, reuse=self._initial_anchor_eval())
            row.update(_rows("anchor", anchor_res))
        if self.ema is not None:
            ema_res = anchor_res if self.ema is self.anchor and anchor_res is not None else self._evaluate("ema")
            row.update(_rows("ema", ema_res))
        return row

    def _evaluate(self, which: str, sets: tuple[str, ...] = ("heldout", "validation", "transfer"),
                  reuse=None) -> dict[str, Any]:
        """The policy, the anchor or the weight EMA on the run's held-out sets ({set: result};
        :class:`RunEvaluator`). With a rollout engine whose backend evaluates too (vLLM: ``for_eval``) the engine
        samples: it is given the evaluated weights (the policy's are the version the next rollout asks for; the
        anchor's are not, so that rollout pushes the policy back) and sleeps again after, as after a rollout."""
        averaged = {"anchor": self.anchor, "ema": self.ema}.get(which)
        model = averaged.use(self.model) if averaged is not None else contextlib.nullcontext(self.model)
        # the engine samples where its backend evaluates too; else the evaluator's decode loop (the hf backend's,
        # or with no engine at all)
        evaluates = self.engine is not None and BACKENDS[self.cfg.rollout.backend].for_eval is not None
        with model as m, gathered(m) as g, self._autocast():
            if not evaluates:  # the decode loop (a backend that samples for training only: there too)
                return self.evaluator.run(g, which, self.progress.step, sets, reuse=reuse)
            self.engine.sync(g, version=self.progress.step if which == "policy" else (which, self.progress.step))
            try:
                return self.evaluator.run(g, which, self.progress.step, sets, reuse=reuse, engine=self.engine)
            finally:
                self.engine.after_rollout()

    def _initial_anchor_eval(self) -> dict[str, Any] | None:
        """The step-0 evaluation, for an anchor that is the initial policy, same settings (None: run it)."""
        now = self.progress
        same = (self.anchor_is_initial and now.initial_eval is not None
                and now.initial_eval_settings == self.evaluator.settings)
        return now.initial_eval if same else None

    def save(self) -> Path:
        """Write a checkpoint of whole tensors (any number of processes can resume it). Collective."""
        state = {**self.progress.state(), "scheduler": self.scheduler.state_dict(),
                 "anchor_is_initial": self.anchor_is_initial, "seed": self.cfg.seed, "world": self.dist.world,
                 "teacher_sha256": self.teacher_sha256, "weight_ema": self.weight_ema is not None}
        return save_training(self.run_dir, self.progress.step, self.model, self.anchor, self.optimizer, state,
                             keep=self.cfg.keep_checkpoints, main=self.main, weight_ema=self.weight_ema,
                             keep_every=self.cfg.keep_every)

    def close(self) -> None:
        """Shut the rollout engine down (vLLM's holds a GPU share); nothing else holds resources past train()."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    # ---- pieces ---------------------------------------------------------------------------------------

    def _autocast(self):
        return distributed.autocast(self.cfg.mixed_precision, self.dist)

    def _write(self, row: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.write(row)


def _rows(which: str, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Metrics-row entries of one model's evaluations: eval/{which}_* for the held-out set,
    eval/{set}_{which}_* for the others."""
    return {k: v for name, res in results.items() for k, v in eval_row(which if name == "heldout" else
                                                                        f"{name}_{which}", res).items()}
