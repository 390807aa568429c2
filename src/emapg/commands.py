"""What each ``emapg`` command does, once :mod:`emapg.cli` has parsed it: every command's work, with the modules it
needs imported here, at the top. The command line imports this module only to run a command (its --help imports
no torch); ``COMMANDS`` names each command's function."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from emapg.atomic import one_writer, write_text_atomic
from emapg.config import (
    EVAL_OPTIONS,
    SHIPPED_RECIPES,
    EvalConfig,
    RolloutConfig,
    TrainConfig,
    check_options,
    check_world,
    import_plugins,
    load_config,
    merged_task_args,
    reference,
)
from emapg.errors import ConfigError, regular_file
from emapg.lab.report import check_report_files
from emapg.lab.report import report as study_report
from emapg.lab.study import load_spec, run_all
from emapg.models import distributed, plan
from emapg.retrieval.bm25 import build_index
from emapg.retrieval.dense import build_dense, import_dense
from emapg.retrieval.server import serve
from emapg.run.assembly import host_share
from emapg.run.checkpoint import has_checkpoint, resume_step
from emapg.run.evalsuite import EvalPlan, markdown, parse_sets, resolve_device, resolve_dtype
from emapg.run.evalsuite import run as run_eval
from emapg.run.evaluate import eval_sampling
from emapg.run.export import export_checkpoint
from emapg.run.folder import (
    LAUNCHER_ENV,
    LOCK_ENV,
    MARKER,
    RESUME_ENV,
    check_resume,
    claim_run_folder,
    die_with_parent,
    lock_run,
    run_finished,
    stop_child,
    unlock_run,
)
from emapg.run.trainer import Trainer
from emapg.tasks import task_args_problems
from emapg.tasks.multihop_kb import make_kb

DEFAULT_RECIPE = "cpu_demo"


def recipe_path(name_or_path: str) -> Path:
    """A config file: a path, or the name of a recipe shipped with emapg (``smoke``, ``cpu_demo.yaml``)."""
    if not str(name_or_path).strip():  # an unset shell variable in --config "$CFG": not the default recipe
        raise ConfigError("--config: empty (give a config file or a recipe's name, or leave --config out for the "
                          "default)")
    path = Path(name_or_path)
    regular_file(path, "--config")
    if path.exists():
        return path
    shipped = SHIPPED_RECIPES / (path.name if path.suffix == ".yaml" else f"{path.name}.yaml")
    if path.parent == Path(".") and shipped.exists():
        return shipped
    names = ", ".join(sorted(p.stem for p in SHIPPED_RECIPES.glob("*.yaml")))
    raise ConfigError(f"--config {name_or_path}: no such file, and no recipe of that name (recipes: {names})")


def _launch(args: argparse.Namespace, run_dir: Path) -> int:
    """Re-run this command under torchrun with ``args.nproc`` processes on this machine."""
    cmd = [sys.executable, "-m", "emapg.launcher", "--standalone", f"--nproc_per_node={args.nproc}",
           "-m", "emapg", "train"]
    cmd += ["--resume", str(run_dir)] if args.resume else ["--out", str(run_dir)]
    cmd += ["--force"] if args.force else []
    cmd += ["--trust-plugins"] if args.trust_plugins else []
    if args.config is not None:
        cmd += ["--config", str(recipe_path(args.config))]
    # this process holds the folder's lock for them; its PID lets a worker see that it outlived it
    env = {**os.environ, LOCK_ENV: str(run_dir.resolve()), LAUNCHER_ENV: str(os.getpid()),
           RESUME_ENV: f"emapg train --resume {run_dir} --nproc {args.nproc}"}
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
        cfg = load_config(cfg_file, args.overrides, trust_plugins=args.trust_plugins, task_check=task_args_problems,
                          of_run=True)
    else:
        cfg = load_config(recipe_path(DEFAULT_RECIPE if args.config is None else args.config), args.overrides,
                          trust_plugins=args.trust_plugins, task_check=task_args_problems)
        run_dir = Path(args.out or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{cfg.task}")
        if args.force and cfg.init_from is None:  # a new run replays nothing: the flag would change nothing
            raise ConfigError("--force: only with --resume (or a config's init_from), where it accepts changes to "
                              "what the resumed steps replay; a new run has nothing to force")
    if args.nproc > 1 and not launched:  # the batch must split over the processes: said once, before torchrun
        check_world(cfg, args.nproc)
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
    if args.nproc > 1 and not launched:
        return _launch(args, run_dir)
    trainer = Trainer(cfg, run_dir, resume=bool(args.resume), force=args.force)
    if change is not None:
        change.record()
    if trainer.run.main:
        print(f"emapg: run folder {run_dir} ({trainer.run.dist.world} process(es), {trainer.run.dist.device})",
              file=sys.stderr)
        if args.resume:
            print(f"emapg: resumed at step {trainer.run.progress.step}, training on to step {cfg.steps}",
                  file=sys.stderr)
    try:
        table = trainer.train()
    except BaseException as e:
        if trainer.run.main:
            nproc = f" --nproc {trainer.run.dist.world}" if trainer.run.dist.world > 1 else ""
            how = (f"resume with: emapg train --resume {run_dir}{nproc}" if has_checkpoint(run_dir) else
                   f"no checkpoint yet: run the same command again to start over in {run_dir}")
            what = "stopped" if isinstance(e, KeyboardInterrupt) else "failed"
            print(f"emapg: the run {what} at step {trainer.run.progress.step}; {how}", file=sys.stderr)
        raise
    finally:
        trainer.close()
    if trainer.run.main and table is not None:
        print((run_dir / "eval.md").read_text())  # the trainer wrote it
    distributed.shutdown()
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    if args.step is not None and args.step < 0:
        raise ConfigError(f"--step: must be >= 0, got {args.step}")
    out = export_checkpoint(Path(args.run), out=args.out, step=args.step, trust_plugins=args.trust_plugins)
    print(f"emapg: wrote {out / 'policy'} and {out / 'anchor'}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    cfg = load_config(recipe_path(DEFAULT_RECIPE if args.config is None else args.config), args.overrides,
                      trust_plugins=args.trust_plugins, task_check=task_args_problems)
    if args.gpu_memory is None:  # a GPU's 80 GiB, or on the CPU this host's memory shared by the processes

        host = host_share(max(args.gpus, 1)) if args.device == "cpu" else None
        args.gpu_memory = 80.0 if host is None else host / 2**30
    responses = 1 if args.response_tokens is None else args.response_tokens  # 0 is refused, not "not given"
    for name, value in (("--gpus", args.gpus), ("--gpu-memory", args.gpu_memory),
                        ("--prompt-tokens", args.prompt_tokens), ("--response-tokens", responses)):
        if not value > 0 or value == float("inf"):  # NaN compares false: refused too
            raise ConfigError(f"{name}: must be a finite number > 0, got {value}")
    print(plan.report(cfg, gpus=args.gpus, gpu_memory_gb=args.gpu_memory, prompt_tokens=args.prompt_tokens,
                 response_tokens=args.response_tokens, device=args.device))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:

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
    eval_plan = EvalPlan(models=models, task=task, task_args=task_args, sets=parse_sets(args.data), spec=spec,
                         device=device, dtype=dtype, backend=args.backend,
                         batch_size=args.batch_size, size=args.size, seed=args.seed, protocol=args.protocol,
                         seeding=args.seeding)
    out = Path(args.out) if args.out else None
    if out is not None:

        if (out / MARKER).exists():  # its eval.json is the run's own (compare reads it): never overwritten here
            raise ConfigError(f"--out {out}: a run folder, whose eval.json and eval.md are its training's; write "
                              f"the evaluation elsewhere (e.g. --out {out / 'eval'})")
        out.mkdir(parents=True, exist_ok=True)
    rows = run_eval(eval_plan, out)

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

        try:
            regular_file(Path(args.run) / "config.yaml", "--run")  # a FIFO would be read for ever
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
    cfg = load_config(run / "config.yaml", trust_plugins=args.trust_plugins, task_check=task_args_problems,
                      of_run=True)
    if args.task and args.task != cfg.task:
        raise ConfigError(f"--task {args.task}: the run {run} trained on {cfg.task}")
    models = args.model or [str(run / "export" / m) for m in ("policy", "anchor", "ema")
                            if m != "ema" or (run / "export" / m).exists()]  # a weight EMA of its own: exported
    missing = [m for m in models if not Path(m).exists() and not args.model]
    if missing:
        raise ConfigError(f"--run {run}: no exported model at {missing[0]} (the run exports at its end)")
    return models, cfg.task, merged_task_args(cfg.task_args, task_args)


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
    with one_writer(Path(args.index), "--index"):
        meta = build_dense(args.index, args.embedder, batch_size=args.batch_size, factory=args.factory,
                           device=args.device, search_params=search_params(args.search_param),
                           train_size=args.train_size)
    print(f"emapg index: {meta['documents']} passages encoded by {meta['embedder']} ({meta['dim']} dimensions, "
          f"faiss {meta['factory']}) into {Path(args.index) / 'dense'} in {meta['build_seconds']:.0f} s",
          file=sys.stderr)
    return 0


def cmd_index_import(args: argparse.Namespace) -> int:
    with one_writer(Path(args.index), "--index"):
        meta = import_dense(args.index, args.faiss, args.embedder, corpus=args.corpus,
                            fields=corpus_fields(args.fields), query_prefix=args.query_prefix, link=not args.copy)
    print(f"emapg index: {meta['documents']} vectors of {args.faiss} ({meta['dim']} dimensions, "
          f"{meta['factory']}) taken as {Path(args.index) / 'dense'}, queries encoded by {meta['embedder']} "
          f"with prefix {meta['query_prefix']!r}", file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import_plugins(args.plugins or [])
    serve(args.index, host=args.host, port=args.port, allow_remote=args.allow_remote, retriever=args.retriever,
          search_params=search_params(args.search_param), device=args.device, max_queries=args.max_queries,
          max_query_chars=args.max_query_chars, max_topk=args.max_topk,
          max_body_bytes=args.max_body_bytes)
    return 0


def cmd_kb_make(args: argparse.Namespace) -> int:
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
    spec = load_spec(args.spec, quick=args.quick, only=args.only, extra=args.overrides,
                     trust_plugins=args.trust_plugins)
    out = Path(args.out)
    check_report_files(spec, out)  # before hours of runs, not after
    if not args.report_only:
        run_all(spec, out, log=lambda m: print(f"emapg compare: {m}", file=sys.stderr, flush=True), jobs=args.jobs)
    print(study_report(spec, out))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    if args.show is None:
        if args.overrides:
            raise ConfigError(f"{' '.join(args.overrides)}: overrides go with --show CONFIG")
        print(reference.markdown() if args.markdown else reference.text(), end="")
        return 0
    cfg = load_config(recipe_path(args.show), args.overrides, trust_plugins=args.trust_plugins,
                      task_check=task_args_problems)
    print(reference.resolved(cfg), end="")
    return 0


COMMANDS = {"train": cmd_train, "export": cmd_export, "plan": cmd_plan, "eval": cmd_eval, "config": cmd_config,
            "index_build": cmd_index_build, "index_dense": cmd_index_dense, "index_import": cmd_index_import,
            "serve": cmd_serve, "kb_make": cmd_kb_make, "compare": cmd_compare}
"""Each command's function, by the name its parser gives (emapg.cli)."""
