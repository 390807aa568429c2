"""Held-out evaluation: accuracy of a model on a task's examples, and a training run's evaluations
(each process evaluates its share; the results combine)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from emapg.atomic import append_line, write_json_atomic, write_text_atomic
from emapg.errors import ConfigError
from emapg.models import distributed
from emapg.rollout import rollout_for_task
from emapg.rollout.sampling import SamplingSpec
from emapg.run.metrics import metrics_lines
from emapg.run.teacher_kl import TeacherKL
from emapg.tasks import make_task
from emapg.tasks.base import Example, Task, held_out_examples, score_completions

RANK_SEED_STRIDE = 7919  # rank r samples with seed + r * stride; rank 0 (and a single process) with seed


def eval_sampling(cfg: Any) -> SamplingSpec:
    """How a training run evaluates: greedy, or ``eval.samples`` samples per problem at the eval temperature
    and top-p, with the eval budget (each the rollout's when unset)."""
    e, r = cfg.eval, cfg.rollout
    return SamplingSpec(n=e.samples, temperature=r.temperature if e.temperature is None else e.temperature,
                        top_p=r.top_p if e.top_p is None else e.top_p, greedy=e.greedy,
                        max_new_tokens=e.max_new_tokens or r.max_new_tokens)


def eval_settings(cfg: Any, world: int, device: str) -> dict[str, Any]:
    """What a run's evaluation numbers depend on besides the weights (a resume may change them)."""
    spec = eval_sampling(cfg)
    return {"size": cfg.eval.size, "samples": spec.n, "max_new_tokens": spec.max_new_tokens, "greedy": spec.greedy,
            "temperature": spec.temperature, "top_p": spec.top_p, "mixed_precision": cfg.mixed_precision,
            "dtype": cfg.dtype, "seed": cfg.seed, "world": world, "device": device}


def evaluate_shared(model: nn.Module, tokenizer, task: Task, examples: list[Example], spec: SamplingSpec, *,
                    rank: int, world: int, seed: int, progress: str | None = None,
                    max_rows: int | None = None, engine=None) -> dict[str, Any]:
    """:func:`evaluate` of this process's share of ``examples`` (every ``world``-th from ``rank``), seeded
    ``seed`` (per rank) inside a forked RNG, so evaluation never shifts the training randomness; the
    shares' results combined (collective when ``world > 1``). ``engine``: the run's rollout engine, holding
    the model's weights, samples instead of the decode loop."""
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed + RANK_SEED_STRIDE * rank)
        res = evaluate(model, tokenizer, task, examples[rank::world], spec, progress=progress, outcomes=True,
                       max_rows=max_rows, engine=engine,
                       seed=None if engine is None else seed + RANK_SEED_STRIDE * rank)
    return combine_evals(distributed.all_gather_objects(res)) if world > 1 else res


def eval_row(which: str, res: dict[str, Any]) -> dict[str, Any]:
    """Metrics-row entries of an evaluation: accuracy, response length, rollout diagnostics."""
    row = {f"eval/{which}_accuracy": res["accuracy"], f"eval/{which}_length": res["mean_length"]}
    if "teacher_kl" in res:  # a distillation run: the exact reverse KL to the teacher on its own responses
        row[f"eval/{which}_teacher_kl"] = res["teacher_kl"]
    row.update({f"eval/{which}_{k[: -len('_mean')]}": v for k, v in res.items() if k.endswith("_mean")})
    return row


def combine_evals(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One evaluation result from the results of disjoint shares of the examples."""
    num = sum(p["num"] for p in parts)
    out = dict(parts[0])
    out["num"] = num
    # Means over samples, or over problems (pass@k): every problem has the same number of samples,
    # so both are weighted by the number of samples.
    for key in ["accuracy", "mean_length"] + [k for k in parts[0] if k.startswith("pass@") or k.endswith("_mean")]:
        out[key] = sum(p[key] * p["num"] for p in parts) / max(num, 1)
    if "solved" in parts[0]:
        out["solved"] = {k: v for p in parts for k, v in p["solved"].items()}
    return out


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n - c, k) / C(n, k) (Chen et al., 2021)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@torch.no_grad()
def evaluate(model: nn.Module, tokenizer, task: Task, examples: list[Example], spec: SamplingSpec, *,
             batch_size: int = 64, progress: str | None = None, record: bool = False,
             outcomes: bool = False, engine=None, seed: int | None = None,
             max_rows: int | None = None) -> dict[str, Any]:
    """Mean reward over ``examples`` x ``spec.n`` samples (avg@n: pass@1 averaged over n samples).

    Returns {'accuracy' (= avg@n), 'pass@k' for k = 1, 2, 4, ... <= n, 'mean_length', 'num'}.
    A reward >= 1 counts as correct for pass@k. Greedy decoding uses one sample per example.
    ``progress``: a label for a progress bar over the problems (on stderr), or None for none.
    ``record``: also return 'records', one {id, prompt, answer, completion, reward} per sample (the
    transcripts behind the number; an agent's completion includes the environment's information blocks).
    ``outcomes``: also return 'solved', {problem id: how many of its samples were correct}.
    ``engine``: a vLLM engine holding the model's weights samples instead (``seed`` seeds its batches).
    ``max_rows``: the hf backend decodes at most this many rows at once (``rollout.max_rows``).
    """
    n = spec.n
    total, length, count = 0.0, 0.0, 0
    correct: list[int] = []
    solved: dict[str, int] = {}
    stats: dict[str, float] = {}
    records: list[dict[str, Any]] = []
    # Batches of similar prompt length waste less compute on left padding (order does not matter here).
    examples = sorted(examples, key=lambda ex: sum(len(m["content"]) for m in ex.messages))
    bar = tqdm(total=len(examples), desc=progress, unit="problem", leave=False, disable=progress is None)
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        batch = rollout_for_task(model, tokenizer, task, chunk, spec, engine=engine,
                                 seed=None if seed is None else seed + start, max_rows=max_rows)
        rewards = score_completions(task, batch.completions, chunk, n, evaluation=True, truncated=batch.truncated)
        total += float(rewards.sum())
        correct += (rewards >= 1.0).view(-1, n).sum(1).tolist()
        solved.update(zip((ex.id for ex in chunk), correct[-len(chunk):], strict=True))
        if record:
            records += [{"id": ex.id, "prompt": ex.messages[-1]["content"], "answer": ex.answer,
                         "completion": batch.completions[i * n + j], "reward": float(rewards[i * n + j])}
                        for i, ex in enumerate(chunk) for j in range(n)]
        length += float(batch.response_mask.sum())
        count += len(batch.completions)
        for key, v in batch.stats.items():
            stats[key] = stats.get(key, 0.0) + float(v.sum())
        bar.update(len(chunk))
    bar.close()
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64) if k <= n]
    out = {"accuracy": total / max(count, 1), "mean_length": length / max(count, 1), "num": count, "samples": n}
    out.update({f"{key}_mean": v / max(count, 1) for key, v in stats.items()})  # e.g. searches per episode
    for k in ks:
        out[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in correct) / max(len(correct), 1)
    if record:
        out["records"] = records
    if outcomes:
        out["solved"] = solved
    return out


def validation_examples(task: Task, size: int, validation: int) -> list[Example]:
    """The ``validation`` held-out problems after the first ``size`` (the test set): disjoint from it and from
    training. Refused, naming what to change, when the task's held-out set has fewer than ``size + validation``."""
    every = held_out_examples(task, size + validation)
    if len(every) < size + validation:
        raise ConfigError(f"eval.validation_size: {validation} after eval.size {size} needs {size + validation} "
                          f"held-out problems; the task has {len(every)} (a generated task: raise its "
                          "task_args.eval_size; a data file: more rows, or a smaller eval.size)")
    return every[size:]


class RunEvaluator:
    """A training run's held-out evaluations: the held-out set (``eval.size`` problems) and, with
    ``eval.transfer``, a second set from a distribution the run does not train on (the task built with
    those task_args overrides), each for the policy and the anchor; with ``eval.validation_size``, a validation
    set (the held-out problems after the test set's) to choose the model to ship by. Each evaluation's per-problem
    outcomes go to ``RUN/outcomes/outcomes.jsonl`` as it finishes, one line of 0/1 digits in the order
    of the set's ids (``RUN/outcomes/SET.ids.json``), so two runs can be compared problem by problem
    (:func:`emapg.stats.mcnemar_p`)."""

    def __init__(self, cfg: Any, task: Task, tokenizer, run_dir, dist: distributed.DistInfo, progress: bool,
                 fit=None):
        """``fit(task)``: what the trainer checks every prompt with (the context length): applied to the
        transfer task too, before its set is drawn."""
        self.cfg, self.tokenizer, self.main = cfg, tokenizer, dist.is_main
        self.rank, self.world = dist.rank, dist.world
        self.spec, self.settings = eval_sampling(cfg), eval_settings(cfg, dist.world, dist.device.type)
        self.progress = progress and self.main
        self.sets: dict[str, tuple[Task, list[Example]]] = {}
        if cfg.eval.size:
            self.sets["heldout"] = (task, held_out_examples(task, cfg.eval.size))
        if cfg.eval.size and cfg.eval.validation_size:
            self.sets["validation"] = (task, validation_examples(task, cfg.eval.size, cfg.eval.validation_size))
        if cfg.eval.size and cfg.eval.transfer:
            other = make_task(cfg.task, **{**cfg.task_args, **cfg.eval.transfer})
            if fit is not None:
                fit(other)
            self.sets["transfer"] = (other, held_out_examples(other, cfg.eval.transfer_size or cfg.eval.size))
        self.teacher_kl = None  # a distillation run's TeacherKL (use_teacher)
        self.folder = Path(run_dir) / "outcomes"
        if self.main and self.sets:
            self.folder.mkdir(parents=True, exist_ok=True)
            for name, (_, examples) in self.sets.items():
                write_json_atomic(self.folder / f"{name}.ids.json", [ex.id for ex in examples])

    def use_teacher(self, teacher: nn.Module, temperature: float) -> None:
        """Measure, with every held-out evaluation, the model's exact reverse KL to a distillation teacher
        on the teacher's own greedy responses to the held-out prompts (:mod:`emapg.run.teacher_kl`)."""
        if "heldout" in self.sets and self.cfg.eval.teacher_kl:
            task, examples = self.sets["heldout"]
            self.teacher_kl = TeacherKL(teacher, self.tokenizer, task, examples, self.spec.max_new_tokens,
                                        temperature, rank=self.rank, world=self.world)

    @property
    def examples(self) -> list[Example]:
        return self.sets["heldout"][1] if "heldout" in self.sets else []

    def forget_after(self, step: int) -> None:
        """A resumed run replays the steps after ``step``: their outcome lines are dropped."""
        path = self.folder / "outcomes.jsonl"
        if self.main and path.exists():
            # read as metrics.jsonl is: a stray byte or a row without a whole step named, never rewritten
            keep = [line for line, row in metrics_lines(path) if row["step"] <= step]
            write_text_atomic(path, "".join(line + "\n" for line in keep))

    def run(self, model: nn.Module, which: str, step: int,
            sets: tuple[str, ...] = ("heldout", "validation", "transfer"),
            reuse: dict[str, Any] | None = None, engine=None) -> dict[str, dict[str, Any]]:
        """Evaluate ``model`` (``which``: policy, anchor or ema; gathered, in its autocast) on the sets; returns
        {set: result}. ``reuse``: a held-out result already measured for this model (not run again).
        ``engine``: the run's rollout engine, holding ``model``'s weights, samples (else the decode loop)."""
        out = {}
        for name in sets:
            if name not in self.sets:
                continue
            task, examples = self.sets[name]
            if name == "heldout" and reuse is not None:
                res = reuse
            else:
                where = "" if name == "heldout" else f" on the {name} set"
                label = f"eval {which}{where} at step {step} ({len(examples)} problems)" if self.progress else None
                res = evaluate_shared(model, self.tokenizer, task, examples, self.spec, rank=self.rank,
                                      world=self.world, seed=self.cfg.seed, progress=label,
                                      max_rows=self.cfg.rollout.max_rows, engine=engine)
                if name == "heldout" and self.teacher_kl is not None:
                    res["teacher_kl"] = self.teacher_kl(model)
            self._record(name, which, step, res)
            out[name] = res
        return out

    def _record(self, name: str, which: str, step: int, res: dict[str, Any]) -> None:
        if not (self.main and self.cfg.eval.outcomes and "solved" in res):
            return
        solved = res["solved"]
        digits = "".join(str(min(9, solved[ex.id])) for ex in self.sets[name][1])
        append_line(self.folder / "outcomes.jsonl", json.dumps({"step": step, "set": name, "model": which,
                                                                  "solved": digits}))
