"""``emapg eval``: the paper's evaluation protocol over several sets in one call, on the device the models run on.

A set is a file (``--data NAME=FILE`` or ``FILE``, named by its stem) in one of the published formats the
task reads (:func:`emapg.tasks.math.math_rows`, :func:`emapg.tasks.search_qa.qa_rows`); a file whose rows name
several sources (Search-R1's merged ``test.parquet``, its ``data_source`` column) gives one set per source.
Every model is evaluated on every set with the same :class:`SamplingSpec` (n samples at T and top-p, or
greedy), by emapg's decode loop in bounded batches or by a vLLM engine; under torchrun each process takes every
world-th problem of each set on its own GPU and the results are combined (greedy: the table one process gives).
The result is a row per (model, set) with avg@n, pass@k and the mean length, and per model the average over its
sets weighted by their problems (the reference's aggregate) and unweighted: the table the paper prints.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from emapg.atomic import naming_failed_writes, write_text_atomic
from emapg.backends import BACKENDS
from emapg.config import ConfigError
from emapg.models import distributed
from emapg.models.zoo import load_model
from emapg.rollout.prompts import context_length, fit_prompts
from emapg.rollout.sampling import SamplingSpec
from emapg.run.evaluate import RANK_SEED_STRIDE, combine_evals, evaluate
from emapg.tasks import make_task
from emapg.tasks.base import held_out_examples


@dataclass(frozen=True)
class EvalPlan:
    """What one ``emapg eval`` call does, checked before any model loads."""

    models: list[str]
    task: str
    task_args: dict[str, Any]
    sets: list[tuple[str, str | None]]  # (name, file); file None = the task's own held-out set
    spec: SamplingSpec
    device: str
    dtype: str
    backend: str
    batch_size: int
    size: int
    seed: int
    protocol: str | None = None  # "paper": the reference's evaluation (recorded with the results)
    seeding: str = "independent"  # "reference": a problem's n samples share one seed (one sample, repeated)


def parse_sets(items: list[str] | None) -> list[tuple[str, str | None]]:
    """``--data`` items: ``NAME=FILE`` or ``FILE`` (named by its stem, numbered when a name repeats)."""
    if not items:
        return [("heldout", None)]
    named = []
    for item in items:
        name, eq, path = item.partition("=")
        if not eq or "/" in name or not name:
            name, path = Path(item).name.split(".")[0], item
        if not path.strip():
            raise ConfigError(f"--data {item}: no file after {name}= (NAME=FILE, or FILE)")
        named.append((name, path))
    return list(zip(unique_names([n for n, _ in named]), [p for _, p in named], strict=True))


def unique_names(names: list[str]) -> list[str]:
    """The names in order, a repeated one numbered (``nq``, ``nq-2``): two sets never share a row of the table
    or a samples file (two Search-R1 files with the same ``data_source`` are two sets)."""
    out: list[str] = []
    for name in names:
        unique, i = name, 2
        while unique in out:
            unique, i = f"{name}-{i}", i + 1
        out.append(unique)
    return out


def resolve_device(device: str) -> str:
    """auto = cuda when a GPU is visible, else cpu; an unavailable cuda is a one-line error (the name itself is
    checked by the config's ``device`` rule). The training's rule, with the command line's option name."""
    return str(distributed.resolve_device(device, "--device"))


def resolve_dtype(dtype: str, device: str) -> str:
    """auto = bfloat16 on a GPU (the paper's evaluation precision), float32 on the CPU; any other name is
    checked by the config's ``dtype`` rule."""
    if dtype == "auto":
        return "bfloat16" if device.startswith("cuda") else "float32"
    return dtype


def sets_of(task, name: str, size: int) -> list[tuple[str, list]]:
    """The task's held-out examples as sets: one, or one per ``data_source`` when its rows name several."""
    examples = held_out_examples(task, size)
    sources = [ex.meta.get("data_source") for ex in examples]
    if len(set(sources)) <= 1 or any(s is None for s in sources):
        return [(name, examples)]
    order = list(dict.fromkeys(sources))
    return [(str(src), [ex for ex, s in zip(examples, sources, strict=True) if s == src]) for src in order]


def run(plan: EvalPlan, out: Path | None, log=lambda m: print(m, file=sys.stderr)) -> list[dict[str, Any]]:
    """Evaluate every model on every set; returns the rows (and writes eval.json, eval.md and every
    completion, ``MODEL__SET.samples.jsonl``, into ``out``)."""


    tasks = []
    for name, path in plan.sets:  # every file read and checked before the first model loads
        targs = dict(plan.task_args) if path is None else {**plan.task_args, "eval_file": path, "train_file": None}
        if path is not None and plan.task == "arithmetic":
            raise ConfigError("--data: the arithmetic task generates its problems (leave --data out)")
        tasks.append((name, make_task(plan.task, **targs)))
    open_engine = eval_engine_builder(plan.backend)  # a backend that cannot evaluate is refused before loading
    rows: list[dict[str, Any]] = []
    labels = model_labels(plan.models)
    rank, world, device = eval_processes(plan.device)
    seed = plan.seed + RANK_SEED_STRIDE * rank  # rank 0 (and one process) samples with the seed itself
    named = unique_names([name for set_name, task in tasks for name, _ in sets_of(task, set_name, plan.size)])
    for model_name in plan.models:
        torch.manual_seed(plan.seed)
        model, tok = load_model(model_name, plan.dtype)
        model.to(device).eval()
        engine = None if open_engine is None else open_engine(
            model, tok, [t for _, t in tasks], plan.spec, device=device, dtype=plan.dtype, seed=seed,
            rows=plan.batch_size * plan.spec.n)
        try:
            names = iter(named)
            for set_name, task in tasks:
                for (_, examples), name in zip(sets_of(task, set_name, plan.size), names, strict=False):
                    # only the rows this call evaluates (--size of each set) must fit
                    fit_prompts(_Chosen(examples), tok, context_length(model), plan.spec.max_new_tokens, "error",
                                advice="leave the row out of the file, or evaluate with a smaller "
                                       "--max-new-tokens")
                    torch.manual_seed(seed)
                    spec = replace(plan.spec, n=1) if plan.seeding == "reference" else plan.spec
                    res = evaluate(model, tok, task, examples[rank::world], spec, batch_size=plan.batch_size,
                                   progress=f"eval {name} ({len(examples)} problems)" if rank == 0 else None,
                                   record=out is not None, engine=engine, seed=seed)
                    if plan.seeding == "reference":
                        res = repeated_sample(res, plan.spec.n)
                    res, records = _combined(res, world)
                    rows.append({"model": model_name, "dataset": name, "problems": len(examples), **res})
                    if rank == 0:
                        log(f"emapg eval: {model_name}: {name}: avg@{plan.spec.n} {100 * res['accuracy']:.1f}% "
                            f"over {len(examples)} problems" + (f" ({world} processes)" if world > 1 else ""))
                    if out is not None and rank == 0:
                        _write_records(out, labels[model_name], name, records)
        finally:
            if engine is not None:
                engine.close()
        del model
    if out is not None and rank == 0:
        settings = {"models": plan.models, "task": plan.task, "samples": plan.spec.n, "greedy": plan.spec.greedy,
                    "temperature": None if plan.spec.greedy else plan.spec.temperature, "top_p": plan.spec.top_p,
                    "max_new_tokens": plan.spec.max_new_tokens, "device": plan.device, "dtype": plan.dtype,
                    "backend": plan.backend, "seed": plan.seed, "protocol": plan.protocol, "seeding": plan.seeding,
                    "grader": plan.task_args.get("grader")}
        write_text_atomic(out / "eval.json", json.dumps({**settings, "rows": rows}, indent=1))
        write_text_atomic(out / "eval.md", markdown(rows))
    return rows


class _Chosen:
    """The examples one evaluation takes, as the pools :func:`emapg.rollout.prompts.fit_prompts` checks."""

    def __init__(self, examples: list):
        self.examples = examples

    def prompt_pools(self) -> list[list]:
        return [self.examples]


def repeated_sample(res: dict[str, Any], n: int) -> dict[str, Any]:
    """An evaluation of one sample a problem read as the reference's n samples drawn with one seed: the reference's
    engine sends ``seed`` (429) with each of its n requests for a problem, so their n samples are one sample
    repeated. avg@n is that sample's accuracy (the same expectation as n independent samples, one sample's
    variance); pass@k is pass@1 for every k <= n; the records are that sample, n times."""
    out = {**res, "samples": n, "num": res["num"] * n}
    out.update({f"pass@{k}": res["pass@1"] for k in (1, 2, 4, 8, 16, 32, 64) if k <= n})
    if "solved" in res:
        out["solved"] = {k: v * n for k, v in res["solved"].items()}
    if "records" in res:
        out["records"] = [r for r in res["records"] for _ in range(n)]
    return out


def eval_processes(device: str) -> tuple[int, int, str]:
    """(rank, world, device) of this ``emapg eval`` process: one process, or under torchrun each process with
    its share of every set (every ``world``-th problem) on its own device (cuda:LOCAL_RANK)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1, device

    info = distributed.init(device)
    return info.rank, info.world, str(info.device)


def _combined(res: dict[str, Any], world: int) -> tuple[dict[str, Any], list[dict]]:
    """One process's result of its share and its transcripts -> the whole set's (collective when world > 1)."""
    records = res.pop("records", [])
    if world <= 1:
        return res, records
    return combine_evals(distributed.all_gather_objects(res)), [r for part in distributed.all_gather_objects(records)
                                                                for r in part]


def eval_engine_builder(name: str):
    """Backend ``name``'s builder of an evaluation engine (it holds a model's weights and samples); None:
    emapg's decode loop (hf). A backend that samples for training only is a one-line error."""
    backend = BACKENDS[name]
    open_engine = backend.builder("for_eval")
    if open_engine is None and backend.for_run is not None:
        raise ConfigError(f"--backend {name}: the backend samples for training only (no for_eval)")
    return open_engine


def model_labels(models: list[str]) -> dict[str, str | None]:
    """How each model's transcripts are named: nothing for one model; else its folder's name, or with two of
    one name (runs/a/export/policy, runs/b/export/policy) as many of its path's last parts as tell them apart."""
    if len(models) == 1:
        return {models[0]: None}
    for depth in range(1, 1 + max(len(Path(m).parts) for m in models)):
        labels = {m: "-".join(Path(m).parts[-depth:]).replace("/", "") for m in models}
        if len(set(labels.values())) == len(models):
            return labels
    return {m: f"model{i}" for i, m in enumerate(models)}  # the same path twice


def _write_records(out: Path, label: str | None, name: str, records: list[dict]) -> None:
    stem = f"{label}__{name}" if label else name
    target = out / f"{stem}.samples.jsonl"
    with naming_failed_writes(target), open(target, "w") as f:  # a full disk names the file
        f.writelines(json.dumps(r, default=str) + "\n" for r in records)


def markdown(rows: list[dict[str, Any]]) -> str:
    """A row per (model, set): problems, samples, avg@n, pass@k, mean tokens (and agent diagnostics); per
    model its sets' unweighted average; then, with several sets, the paper's summary (models x sets, avg@n)."""
    ks = sorted({k for r in rows for k in r if k.startswith("pass@")}, key=lambda k: int(k[5:]))
    extra = sorted({k for r in rows for k in r if k.endswith("_mean")})  # e.g. searches per episode
    head = ["model", "set", "problems", "samples", "avg@n", *ks, "mean tokens", *(k[: -len("_mean")] for k in extra)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    models = list(dict.fromkeys(r["model"] for r in rows))
    for model in models:
        mine = [r for r in rows if r["model"] == model]
        for r in mine:
            cells = [model, r["dataset"], str(r["problems"]), str(r.get("samples", 1)), f"{100 * r['accuracy']:.1f}"]
            cells += [f"{100 * r[k]:.1f}" if k in r else "" for k in ks] + [f"{r['mean_length']:.0f}"]
            cells += [f"{r[k]:.2f}" if k in r else "" for k in extra]
            lines.append("| " + " | ".join(cells) + " |")
        if len(mine) > 1:
            avg = [f"{100 * sum(r['accuracy'] for r in mine) / len(mine):.1f}"]
            avg += [f"{100 * sum(r[k] for r in mine) / len(mine):.1f}" if all(k in r for r in mine) else ""
                    for k in ks]
            lines.append("| " + " | ".join([model, "average", "", "", *avg, "", *([""] * len(extra))]) + " |")
            total = sum(r["problems"] for r in mine)
            weighted = [f"{100 * sum(r['accuracy'] * r['problems'] for r in mine) / total:.1f}"]
            weighted += [f"{100 * sum(r[k] * r['problems'] for r in mine) / total:.1f}" if all(k in r for r in mine)
                         else "" for k in ks]
            lines.append("| " + " | ".join([model, "average, by problems", str(total), "", *weighted, "",
                                            *([""] * len(extra))]) + " |")
    sets = list(dict.fromkeys(r["dataset"] for r in rows))
    if len(sets) > 1:
        n = rows[0].get("samples", 1)
        lines += ["", f"avg@{n} (%), the paper's layout (the reference's aggregate weighs each set by its problems; "
                  "the unweighted average beside it):", "",
                  "| model | " + " | ".join(sets) + " | average, by problems | average |",
                  "|" + "---|" * (len(sets) + 3)]
        for model in models:
            mine = {r["dataset"]: r for r in rows if r["model"] == model}
            cells = [f"{100 * mine[s]['accuracy']:.1f}" if s in mine else "" for s in sets]
            total = sum(r["problems"] for r in mine.values())
            weighted = sum(r["accuracy"] * r["problems"] for r in mine.values()) / total
            plain = sum(r["accuracy"] for r in mine.values()) / len(mine)
            lines.append(f"| {model} | " + " | ".join(cells) + f" | {100 * weighted:.1f} | {100 * plain:.1f} |")
    return "\n".join(lines) + "\n"
