"""The EMA-PG training loop and step (docs/METHOD.md section 4), the file to read first. It only
orchestrates: every formula lives in kl.py, objective.py, models/lm.py (the log-probs) and anchor.py; what the passes
gather is algo.py's; what a run is made of is built once by run/assembly.py; checkpoints are
run/checkpoint.py's and evaluation is run/evaluate.py's. How a step's batch is cut and the metrics row it
writes are the functions at the end of this file.

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
import math
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from emapg import algo
from emapg.algo import AnchorStats
from emapg.backends import BACKENDS
from emapg.config import TrainConfig
from emapg.models import distributed
from emapg.models.distributed import gathered
from emapg.models.forward import model_logprobs
from emapg.models.lm import set_pass_mode
from emapg.objective import group_advantages
from emapg.rollout.sampling import RolloutBatch, stream_seed
from emapg.run.assembly import Run, assemble
from emapg.run.checkpoint import save_training
from emapg.run.evaluate import RANK_SEED_STRIDE, RunEvaluator, eval_row
from emapg.run.export import export_models
from emapg.run.folder import mark_finished
from emapg.tasks.base import score_completions, training_prompts


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


class Trainer:
    """The loop and the step of a run. ``Trainer(cfg, run_dir)`` assembles the :class:`~emapg.run.assembly.Run`
    it holds as ``run`` (``resume=True``: from its latest checkpoint), the parts every step uses."""

    def __init__(self, cfg: TrainConfig, run_dir: str | Path, resume: bool = False, progress: bool = True,
                 force: bool = False):
        self.run: Run = assemble(cfg, Path(run_dir), resume=resume, progress=progress, force=force)

    # ---- the run, top down -------------------------------------------------------------------------

    def train(self) -> dict[str, Any] | None:
        """Run to ``cfg.steps``; the final eval table {'init'|'policy'|'anchor'[|'ema']: results} on rank 0, else
        None."""
        run = self.run
        cfg, now = run.cfg, run.progress
        if cfg.eval.at_start and run.evaluator.examples and now.step == run.start_step:  # not once it moved
            results = self._evaluate("policy")
            now.initial_eval, now.initial_eval_settings = results["heldout"], start_settings(run.evaluator, now.step)
            self._write({"step": now.step, **_rows("policy", results)})
        bar = tqdm(total=cfg.steps, initial=now.step, disable=not (run.show_progress and run.main), desc="emapg",
                   unit="step")
        while now.step < cfg.steps:
            step = now.step + 1
            row = self.train_step(step)
            now.step = step
            periodic = bool(run.evaluator.examples and cfg.eval.every and step % cfg.eval.every == 0)
            if run.evaluator.examples and (periodic or step == cfg.steps):
                row.update(self._evaluate_models(final=step == cfg.steps))
            self._write(row)
            if cfg.save_every and (step % cfg.save_every == 0 or step == cfg.steps):
                self.save()
            bar.set_postfix(reward=f"{row['reward_mean']:.2f}", kl_estimate=f"{row['kl']:.1e}",  # sampled: may be < 0
                            s=f"{row['step_seconds']:.1f}")
            bar.update(1)
        bar.close()
        if cfg.export:
            export_models(run.run_dir / "export", run.model, run.anchor, run.tokenizer,
                          sharded=run.dist.enabled, main=run.main, plain_model=run.plain_model,
                          weight_ema=run.weight_ema)
        if not run.main:
            return None
        table = run.metrics.finish(now.initial_eval)
        mark_finished(run.run_dir, now.step)  # a resume of a run whose end was cut short finishes it
        return table

    def train_step(self, step: int) -> dict[str, Any]:
        """Rollout, then :meth:`update`; the metrics row of the step."""
        run = self.run
        torch.manual_seed(step_seed(run.cfg.seed, step) + RANK_SEED_STRIDE * run.dist.rank)
        t0 = time.perf_counter()
        batch = self.rollout(step)
        t_gen = time.perf_counter() - t0
        row = {"step": step, **self.update(batch), "gen_seconds": t_gen,
               "responses": run.cfg.prompts_per_step * run.cfg.rollout.n}
        row["step_seconds"] = time.perf_counter() - t0
        return {**row, **peak_memory_row(run.dist.device)}  # this rank's high-water mark of the step

    def rollout(self, step: int) -> RolloutBatch:
        """This rank's share of step ``step``'s prompts, sampled, scored, with group advantages."""
        run = self.run
        cfg = run.cfg
        examples = training_prompts(run.task, cfg.data_order, cfg.seed, step, cfg.prompts_per_step,
                                    step_seed(cfg.seed, step))
        mine = rank_prompts(cfg.prompts_per_step, run.plan.mini_prompts, run.plan.world, run.dist.rank)
        examples = [examples[i] for i in mine]  # the global batch is the same on every rank
        run.engine.sync(run.model, version=run.progress.step)  # the weights after that many updates
        seed = stream_seed(cfg.seed, step, run.dist.rank)  # an engine's requests' (the decode loop: torch's, seeded)
        batch = run.engine.rollout(run.task, examples, run.sampling, seed=seed, device=run.dist.device)
        run.engine.after_rollout()
        batch.rewards = score_completions(run.task, batch.completions, examples, cfg.rollout.n,
                                          truncated=batch.truncated).to(run.dist.device)
        batch.advantages = group_advantages(batch.rewards, cfg.rollout.n, cfg.algo.advantage)
        return batch

    def update(self, batch: RolloutBatch) -> dict[str, Any]:
        """Learn from this rank's share of a scored rollout batch (its rollout metrics first, then with
        ``algo.mask_truncated`` truncated responses masked out of the loss): anchor pass, PPO epochs over
        mini-batches of micro-batches, optimizer steps, EMA update. Returns the metrics (global:
        reduced over ranks)."""
        run = self.run
        cfg, a, plan = run.cfg, run.cfg.algo, run.plan
        t0 = time.perf_counter()
        sampled = rollout_row(batch, cfg.rollout.n)  # what was sampled: a truncated response's length counts
        if a.mask_truncated:  # ... but none of its tokens counts in the loss
            batch.response_mask = batch.response_mask * (~batch.truncated).long()[:, None]
        lr_used = schedule_step_lr(run.optimizer, run.scheduler)
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
        run.optimizer.zero_grad(set_to_none=True)
        ema_updated = run.anchor.step(run.model)
        if run.weight_ema is not None:  # the weights' EMA kept for shipping, outside the loss
            run.weight_ema.step(run.model)
        run.progress.skipped_steps += skipped
        applied = plan.optimizer_steps - skipped
        return {**sampled, **update_row(stats, applied, grad_norms),
                "lr": lr_used, "ema_updated": int(ema_updated), "skipped_updates": skipped,
                "skipped_total": run.progress.skipped_steps, "anchor_seconds": t_anchor}

    @torch.no_grad()
    def anchor_pass(self, mb: RolloutBatch) -> AnchorStats:
        """The no-grad passes of a micro-batch: pi_old when it needs a pass (with its top-k, the sampler's head
        then); the KL's reference (the anchor, or the teacher) at the sampled tokens and at the head ids that
        :func:`emapg.algo.anchor_request` names; the initial policy for the kl_to_init diagnostic."""
        run = self.run
        # pi_old's pass, where one is needed (decided once with the sampling spec), gives the sampler's head
        old = self._logprobs(run.model, mb, k_self=run.head.sampler_k) if run.plan.old_pass else None
        ids, k_self = algo.anchor_request(run.head, mb, run.model.get_output_embeddings().weight.shape[0],
                                          None if old is None else old.topk_ids)
        ref = run.anchor.use(run.model) if run.teacher is None else contextlib.nullcontext(run.teacher)
        with ref as ref_model:
            st = self._logprobs(ref_model, mb, ids=ids, k_self=k_self)
        old = None if old is None else old.logp_tok
        init = None
        if run.init_anchor is not None:
            with run.init_anchor.use(run.model) as init_model:
                init = self._logprobs(init_model, mb).logp_tok
        elif run.cfg.log_kl_to_init:  # the anchor is the initial policy (eta = 1 since step 0)
            init = st.logp_tok
        return algo.anchor_stats(run.head, st, ids, mb, old, init, run.cfg.algo, run.plan.recompute_old)

    def _optimizer_step(self, mbs: list[RolloutBatch],
                        anchors: list[AnchorStats]) -> tuple[list[dict[str, float]], float] | None:
        """One optimizer step on a mini-batch of micro-batches (gradients accumulate). Returns their
        statistics and the grad norm, or None when the update was dropped as non-finite."""
        run = self.run
        world = run.dist.world
        local_tokens = float(sum(mb.response_mask.sum() for mb in mbs))
        counts = {"num_tokens": distributed.all_reduce([local_tokens])[0],
                  "num_seqs": float(run.plan.mini_prompts * run.cfg.rollout.n), "max_len": run.plan.max_response}
        run.optimizer.zero_grad(set_to_none=True)
        stats = []
        for mb, anc in zip(mbs, anchors, strict=True):
            loss, part = self.micro_loss(mb, anc, counts)
            if not distributed.all_agree(bool(torch.isfinite(loss))):
                return self._drop_update()
            # the loss is this rank's share of the global mean; FSDP averages gradients over ranks
            (loss * world if world > 1 else loss).backward()
            stats.append(part)
        norm = distributed.clip_grad_norm(run.params, run.cfg.algo.max_grad_norm)
        if not math.isfinite(norm):
            return self._drop_update()
        run.optimizer.step()
        run.scheduler.step()
        return stats, norm

    def micro_loss(self, mb: RolloutBatch, anc: AnchorStats, counts: dict[str, Any]) -> tuple[Tensor, dict]:
        """The policy pass of one micro-batch, at the anchor's head ids, and :func:`emapg.algo.loss`."""
        run = self.run
        return algo.loss(self._logprobs(run.model, mb, ids=anc.head_ids), anc, mb, run.cfg.algo, counts)

    def _drop_update(self) -> None:
        run = self.run
        run.optimizer.zero_grad(set_to_none=True)
        distributed.reshard(run.model)  # a skipped backward leaves units gathered

    def _logprobs(self, model: torch.nn.Module, mb: RolloutBatch, **kw) -> Any:
        run = self.run
        set_pass_mode(model, grad=torch.is_grad_enabled(), lora_dropout=run.cfg.lora.dropout > 0)
        with self._autocast():
            return model_logprobs(model, mb, **kw, temperature=run.cfg.rollout.temperature,
                                  chunk_size=run.cfg.chunk_size, prefix_sharing=run.cfg.prefix_sharing)

    # ---- evaluation, checkpoints, shutdown ------------------------------------------------------------

    def evaluate(self, which: str = "policy") -> dict[str, Any]:
        """Held-out accuracy of the policy or the anchor (each rank evaluates its share; {} without a set)."""
        res = self._evaluate(which, sets=("heldout",)).get("heldout", {})
        return {k: v for k, v in res.items() if k != "solved"}  # the per-problem outcomes went to RUN/outcomes

    def _evaluate_models(self, final: bool) -> dict[str, Any]:
        """A periodic (or the ``final``) evaluation's metrics: the policy; the anchor (at the end, or every time
        with ``eval.anchor``); the weight EMA (``weight_ema``; with EMA-PG the anchor's results, not run twice).
        The validation set is the policy's and the EMA's: the choice of the model to ship."""
        run = self.run
        row = _rows("policy", self._evaluate("policy"))
        anchor_res = None
        if final or run.cfg.eval.anchor:
            sets = ("heldout", "validation", "transfer") if run.ema is run.anchor else ("heldout", "transfer")
            anchor_res = self._evaluate("anchor", sets=sets, reuse=self._initial_anchor_eval())
            row.update(_rows("anchor", anchor_res))
        if run.ema is not None:
            ema_res = anchor_res if run.ema is run.anchor and anchor_res is not None else self._evaluate("ema")
            row.update(_rows("ema", ema_res))
        return row

    def _evaluate(self, which: str, sets: tuple[str, ...] = ("heldout", "validation", "transfer"),
                  reuse=None) -> dict[str, Any]:
        """The policy, the anchor or the weight EMA on the run's held-out sets ({set: result};
        :class:`RunEvaluator`). With a rollout engine whose backend evaluates too (vLLM: ``for_eval``) the engine
        samples: it is given the evaluated weights (the policy's are the version the next rollout asks for; the
        anchor's are not, so that rollout pushes the policy back) and sleeps again after, as after a rollout."""
        run = self.run
        averaged = {"anchor": run.anchor, "ema": run.ema}.get(which)
        model = averaged.use(run.model) if averaged is not None else contextlib.nullcontext(run.model)
        # the engine samples where its backend evaluates too; else the evaluator's decode loop (the hf backend's,
        # or with no engine at all)
        evaluates = run.engine is not None and BACKENDS[run.cfg.rollout.backend].for_eval is not None
        with model as m, gathered(m) as g, self._autocast():
            if not evaluates:  # the decode loop (a backend that samples for training only: there too)
                return run.evaluator.run(g, which, run.progress.step, sets, reuse=reuse)
            run.engine.sync(g, version=run.progress.step if which == "policy" else (which, run.progress.step))
            try:
                return run.evaluator.run(g, which, run.progress.step, sets, reuse=reuse, engine=run.engine)
            finally:
                run.engine.after_rollout()

    def _initial_anchor_eval(self) -> dict[str, Any] | None:
        """The step-0 evaluation, for an anchor that is the initial policy, same settings (None: run it)."""
        run = self.run
        now = run.progress
        same = (run.anchor_is_initial and now.initial_eval is not None
                and now.initial_eval_settings == run.evaluator.settings)
        return now.initial_eval if same else None

    def save(self) -> Path:
        """Write a checkpoint of whole tensors (any number of processes can resume it). Collective."""
        run = self.run
        state = {**run.progress.state(), "scheduler": run.scheduler.state_dict(),
                 "anchor_is_initial": run.anchor_is_initial, "seed": run.cfg.seed, "world": run.dist.world,
                 "teacher_sha256": run.teacher_sha256, "weight_ema": run.weight_ema is not None}
        return save_training(run.run_dir, run.progress.step, run.model, run.anchor, run.optimizer, state,
                             keep=run.cfg.keep_checkpoints, main=run.main, weight_ema=run.weight_ema,
                             keep_every=run.cfg.keep_every)

    def close(self) -> None:
        """Shut the rollout engine down (vLLM's holds a GPU share); nothing else holds resources past train()."""
        run = self.run
        if run.engine is not None:
            run.engine.close()
            run.engine = None

    # ---- pieces ---------------------------------------------------------------------------------------

    def _autocast(self):
        run = self.run
        return distributed.autocast(run.cfg.mixed_precision, run.dist)

    def _write(self, row: dict[str, Any]) -> None:
        run = self.run
        if run.metrics is not None:
            run.metrics.write(row)


def _rows(which: str, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Metrics-row entries of one model's evaluations: eval/{which}_* for the held-out set,
    eval/{set}_{which}_* for the others."""
    return {k: v for name, res in results.items() for k, v in eval_row(which if name == "heldout" else
                                                                        f"{name}_{which}", res).items()}


# How a step is cut: this process's share of a step as mini-batches (one optimizer step each) of micro-batches (one
# forward and backward each, gradients accumulating), by prompts (``micro_batch_prompts``: whole groups of
# responses) or packed by tokens (``micro_batch_tokens``: verl's dynamic batch size, ``ppo_max_token_len_per_gpu``).
# The cut changes memory, never the gradient: a mini-batch's loss is normalised by its global counts, whatever its
# micro-batches (tests/test_micro_batches.py). Packing keeps the rows in order (a prompt's rows that land together
# share its pass) and makes, on every process, as many micro-batches as the process that needs the most: under
# FSDP2 each is a sequence of collectives that all ranks must make alike (one all-reduce).


def step_micro_batches(batch: RolloutBatch, mini_prompts: int, micro_prompts: int,
                       micro_tokens: int = 0) -> list[list[RolloutBatch]]:
    """This process's rows of a step as mini-batches of ``mini_prompts`` prompts, each cut into micro-batches
    of ``micro_prompts`` prompts, or, with ``micro_tokens`` > 0, packed by tokens (:func:`cut_into`)."""
    if not micro_tokens:  # micro_prompts divides mini_prompts (config.check_world)
        mbs, per = batch.micro_batches(micro_prompts), mini_prompts // micro_prompts
        return [mbs[i : i + per] for i in range(0, len(mbs), per)]
    minis = [slice(s, s + mini_prompts) for s in range(0, batch.num_prompts, mini_prompts)]
    tokens = row_tokens(batch)
    rows = [batch.rows(m) for m in minis]
    fewest = [len(greedy_cuts(tokens[r], micro_tokens)) - 1 for r in rows]
    counts = [int(c) for c in distributed.all_reduce(fewest, op="max")]  # every rank makes as many
    out = []
    for r, parts in zip(rows, counts, strict=True):
        cuts = cut_into(tokens[r], parts, micro_tokens)
        out.append([batch.row_batch(slice(r.start + a, r.start + b)) for a, b in pairwise(cuts)])
    return out


def row_tokens(batch: RolloutBatch) -> list[int]:
    """Each row's tokens, as verl counts them against its budget: its prompt's and its response's up to the
    last token that counts (tool output before it is context the pass runs too)."""
    return (batch.per_row(batch.prompt_mask.sum(1)) + batch.extent()).tolist()


def greedy_cuts(tokens: list[int], budget: int) -> list[int]:
    """Boundaries [0, ..., len(tokens)] of the fewest consecutive runs of rows that each count at most
    ``budget`` tokens (a row over it alone): the greedy cut, which is the fewest for consecutive runs."""
    cuts, total = [0], 0
    for i, t in enumerate(tokens):
        if i > cuts[-1] and total + t > budget:
            cuts.append(i)
            total = 0
        total += t
    return [*cuts, len(tokens)]


def cut_into(tokens: list[int], parts: int, budget: int) -> list[int]:
    """Boundaries of exactly ``parts`` consecutive non-empty runs (1 <= parts <= rows, and at least the fewest
    :func:`greedy_cuts` makes): the greedy cut, whose runs are within ``budget``, then the run with the most
    tokens split where its two halves' tokens are closest, until there are ``parts``; every run stays within
    ``budget`` (or is one row)."""
    cuts = greedy_cuts(tokens, budget)
    if not len(cuts) - 1 <= parts <= len(tokens):
        raise ValueError(f"{parts} runs of {len(tokens)} rows: the greedy cut needs {len(cuts) - 1}")
    while len(cuts) - 1 < parts:
        _, a, b = max((sum(tokens[a:b]), a, b) for a, b in pairwise(cuts) if b - a > 1)
        middle = min(range(a + 1, b), key=lambda m: (abs(sum(tokens[a:m]) - sum(tokens[m:b])), m))
        cuts = sorted([*cuts, middle])
    return cuts


def schedule_step_lr(optimizer: torch.optim.Optimizer, scheduler) -> float:
    """Set the learning rate for a new training step (a schedule by training step changes it here; one by
    optimizer step is unchanged); returns it."""
    for group, lr in zip(optimizer.param_groups, scheduler.base_lrs, strict=True):
        group["lr"] = lr * scheduler.lr_lambdas[0](scheduler.last_epoch)
    return optimizer.param_groups[0]["lr"]


# The step's metrics row: what tells a user when training goes wrong (reward, groups with no signal, entropy,
# lengths, truncation; the KL, clip fractions, ratio, grad norm, the head's mass), reduced over ranks


def add_stats(total: dict[str, float], part: dict[str, float]) -> None:
    """Add one micro-batch's statistics into the step's: sums, and the max of ``*_max`` keys."""
    for key, v in part.items():
        total[key] = max(total.get(key, v), v) if key.endswith("_max") else total.get(key, 0.0) + v


def update_row(stats: dict[str, float], applied: int, grad_norms: list[float]) -> dict[str, Any]:
    """The learning half's metrics from this rank's summed statistics (reduced over ranks here):
    the loss terms per applied update, clip fractions and kl_to_init per token, the ratio's max,
    the mean grad norm before clipping. Collective."""
    summed = sorted(k for k in stats if not k.endswith("_max"))  # every rank holds the same keys
    maxed = sorted(k for k in stats if k.endswith("_max"))
    stats = {**dict(zip(summed, distributed.all_reduce([stats[k] for k in summed]), strict=True)),
             **dict(zip(maxed, distributed.all_reduce([stats[k] for k in maxed], op="max"), strict=True))}
    updates, tokens = max(applied, 1), max(stats.get("tokens", 0.0), 1.0)
    row = {"kl": stats.get("kl", math.nan) / updates, "pg_loss": stats.get("pg_loss", math.nan) / updates,
           "clip_frac": stats.get("clip_frac", 0.0) / tokens,
           "dual_clip_frac": stats.get("dual_clip_frac", 0.0) / tokens,
           "ratio_max": stats.get("ratio_max", math.nan),
           "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else math.nan}
    for key in ("kl_to_init", "tis_weight", "tis_capped_frac", "head_mass", "head_mass_anchor", "tail_token_frac",
                "kl_clamp_frac"):
        if key in stats:  # per token (both sides summed over the epochs)
            row[key] = stats[key] / tokens
    if "kl_tok_sq" in stats:  # the per-token KL estimate's variance over this step's tokens
        mean = stats["kl_tok_sum"] / tokens
        row["kl_tok_var"] = max(stats["kl_tok_sq"] / tokens - mean**2, 0.0)
    return row


def rollout_row(batch, group_size: int) -> dict[str, Any]:
    """The rollout's metrics over every rank's share of the batch: reward, the fraction of groups
    with no learning signal (every reward equal: all wrong or all right), entropy, response length,
    truncation, the mass top-p cut, and the means of the rollout's own diagnostics. Collective."""
    mask = batch.response_mask
    local = {"rewards": batch.rewards.tolist(), "lengths": mask.sum(1).tolist(),
             "stats": {k: v.tolist() for k, v in batch.stats.items()},
             "truncated": batch.truncated.tolist(), "mask": float(mask.sum()),
             "entropy": float((batch.entropy * mask).sum()),
             "top_p_cut": None if batch.top_p_cut is None else float((batch.top_p_cut * mask).sum())}
    parts = distributed.all_gather_objects(local)
    rewards = torch.tensor([x for p in parts for x in p["rewards"]], dtype=torch.float32)
    lengths = torch.tensor([x for p in parts for x in p["lengths"]], dtype=torch.float32)
    truncated = torch.tensor([x for p in parts for x in p["truncated"]], dtype=torch.float32)
    positions = max(sum(p["mask"] for p in parts), 1.0)
    groups = rewards.view(-1, group_size)
    row = {"reward_mean": float(rewards.mean()),
           "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
           "no_signal_frac": float((groups.max(1).values == groups.min(1).values).float().mean()),
           "entropy": sum(p["entropy"] for p in parts) / positions,
           "response_length": float(lengths.mean()), "truncated_frac": float(truncated.mean())}
    if all(p["top_p_cut"] is not None for p in parts):  # the vLLM backend does not measure it
        row["top_p_cut"] = sum(p["top_p_cut"] for p in parts) / positions
    for key in batch.stats:  # rollout diagnostics, e.g. searches per episode
        values = [x for p in parts for x in p["stats"][key]]
        row[f"{key}_mean"] = sum(values) / max(len(values), 1)
    return row


def peak_memory_row(device: torch.device) -> dict[str, float]:
    """On CUDA, this rank's memory high-water marks since the last call (GiB), then reset: what tensors held
    (allocated) and what the allocator took from the GPU (reserved: what must fit); else nothing."""
    if device.type != "cuda":
        return {}
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    reserved = torch.cuda.max_memory_reserved(device) / 2**30
    torch.cuda.reset_peak_memory_stats(device)
    return {"peak_memory_gb": peak, "peak_reserved_gb": reserved}
