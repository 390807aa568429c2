"""Side-by-side comparisons: several configurations x the same seeds x the same budget.

A comparison spec (YAML) names a base recipe, overrides shared by every run, the seeds, and the
configurations (each a list of overrides); ``quick`` may shrink all of it. Each run is a plain
``emapg train`` in its own process and folder (``OUT/<config>/seed<k>``); a finished run (its
eval.json exists) is not run again, so an interrupted comparison continues where it stopped: an
unfinished run resumes from its checkpoint, or, with none, starts again (its old folder moved to
``seed<k>.stale``). One ``emapg compare`` at a time may run into an output folder (a lock says so).
What the runs show is :mod:`emapg.lab.report`'s.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from emapg.atomic import open_lock
from emapg.config import COMPARE_MARKER, TRUST_FLAG, ConfigError, load_config, run_folder_of
from emapg.errors import EmapgError
from emapg.lab.spec import read_spec_file
from emapg.models import distributed
from emapg.run.checkpoint import has_checkpoint
from emapg.run.folder import (
    LOCK_ENV,
    MARKER,
    check_not_busy,
    claim_run_folder,
    die_with_parent,
    run_differs,
    stop_child,
    unlock_run,
)
from emapg.tasks import task_args_problems


@dataclass
class Spec:
    base: Path
    overrides: list[str]
    seeds: list[int]
    configs: dict[str, list[str]]
    labels: dict[str, str] = field(default_factory=dict)
    groups: dict[str, list[str]] = field(default_factory=dict)
    prune_checkpoints: bool = False
    source: Path | None = None  # the spec file (its hypotheses, if it declares any)
    trust_plugins: bool = False  # --trust-plugins: a base inside a run folder may bring its plugins


def load_spec(path: str | Path, quick: bool = False, only: list[str] | None = None,
              extra: list[str] | None = None, trust_plugins: bool = False) -> Spec:
    """Read a comparison spec (:func:`emapg.lab.spec.read_spec_file`: every problem named with its field and the
    file), then check that its base exists and that every config loads, before any run starts. ``extra``:
    KEY=VALUE overrides of the command line, applied to every run after the spec's own (the last word).
    ``trust_plugins``: the user's ``--trust-plugins`` (a base config inside a run folder names plugins)."""
    path = Path(path)
    raw = read_spec_file(path)
    configs = {str(name): [*entry.overrides, *(extra or [])] for name, entry in raw.configs.items()}
    labels = {str(name): entry.label or str(name) for name, entry in raw.configs.items()}
    overrides, seeds = list(raw.overrides), raw.seeds
    if quick and raw.quick is not None:
        overrides += raw.quick.overrides
        seeds = raw.quick.seeds or seeds
        only = only or raw.quick.only
    if only:
        unknown = [n for n in only if n not in configs]
        if unknown:
            raise ConfigError(f"{path}: unknown configs {unknown}; known: {', '.join(configs)}")
        configs = {n: configs[n] for n in only}
    base = Path(raw.base)
    if not base.is_absolute():
        base = (path.parent / base).resolve()
    if not base.exists():
        raise ConfigError(f"{path}: base: {base} does not exist")
    home = run_folder_of(path, or_compare=True)
    named = [o for o in [*overrides, *(o for over in configs.values() for o in over if o not in (extra or []))]
             if o.split("=", 1)[0].strip() == "plugins"]
    if home is not None and named and not trust_plugins:  # a spec is a config's source: the same trust rule
        raise ConfigError(f"{path}: it names plugins ({', '.join(named)}), which are code run on import, from "
                          f"inside the run folder {home}: a spec from a run folder imports none unless you pass "
                          f"{TRUST_FLAG} (read them first)")
    for name, over in configs.items():  # every config is checked before the first run starts
        try:
            load_config(base, [*overrides, *over], trust_plugins=trust_plugins, task_check=task_args_problems)
        except ConfigError as e:
            raise ConfigError(f"{path}: configs.{name}: {e}") from None
    groups = {g: [str(n) for n in names if str(n) in configs] for g, names in raw.groups.items()}
    return Spec(base=base, overrides=overrides, seeds=list(seeds), configs=configs, labels=labels,
                prune_checkpoints=raw.prune_checkpoints, source=path, trust_plugins=trust_plugins,
                groups={g: names for g, names in groups.items() if names})


def run_all(spec: Spec, out: Path, log=print, jobs: int = 1) -> None:
    """Run every (config, seed) not yet finished, one process each, and record its wall time.

    jobs > 1 runs that many at once, each with threads = CPU cores // jobs (torch's threads; a
    run's numbers can differ in the last bits with the thread count, so compare runs made alike).

    A file named STOP_FILE in `out` (`touch OUT/.compare.stop`) stops it gently: it starts no new run,
    lets the running ones finish (recorded as usual) and returns; the file is removed, so the next
    call carries on. (Ctrl-C instead stops the running runs at once; they resume from their last
    checkpoint on the next call.)
    """
    if jobs < 1:
        raise ConfigError(f"--jobs: must be >= 1, got {jobs}")
    if (out / MARKER).exists():
        raise ConfigError(f"--out {out}: is the folder of a training run (emapg train wrote it); a comparison needs "
                          "a folder of its own (nothing was changed)")
    out.mkdir(parents=True, exist_ok=True)
    with open_lock(out / COMPARE_MARKER) as lock:  # a second compare would restart this one's live runs
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"--out {out}: another emapg compare is running into it") from None
        _run_locked(spec, out, log, jobs)


STOP_FILE = ".compare.stop"


def _run_locked(spec: Spec, out: Path, log, jobs: int) -> None:
    stop = out / STOP_FILE
    if stop.exists():  # left from before this call: it was meant for a compare that is no longer running
        stop.unlink()
        log(f"removed {stop}, left from an earlier call")
    total = len(spec.configs) * len(spec.seeds)
    threads = max(1, (os.cpu_count() or 1) // jobs)
    pending: list[tuple[Path, list[str], str]] = []
    done = 0
    for seed in spec.seeds:  # seed-major: a comparison stopped early still has every config at its first seeds
        for name, over in spec.configs.items():
            done += 1
            run = out / name / f"seed{seed}"
            if (run / "eval.json").exists() or has_checkpoint(run):  # the spec's run, or another's left here?
                _check_same_run(spec, run, [*spec.overrides, *over, f"seed={seed}"])
            if (run / "eval.json").exists():
                log(f"[{done}/{total}] {name} seed {seed}: done already")
                continue
            cmd = [sys.executable, "-m", "emapg", "train", "--config", str(spec.base), "--out", str(run),
                   *spec.overrides, *over, f"seed={seed}", *([f"threads={threads}"] if jobs > 1 else []),
                   *(["--trust-plugins"] if spec.trust_plugins else [])]
            if has_checkpoint(run):
                # its config.yaml is the one the user's spec gives (checked above): its plugins are the user's own
                cmd = [sys.executable, "-m", "emapg", "train", "--resume", str(run), "--trust-plugins"]
            elif run.exists():  # stopped before its first checkpoint: start it again, its leftovers set aside
                check_not_busy(run)  # (unless a live writer holds it); the last failure's log stays in .stale
                shutil.rmtree(stale := run.with_name(run.name + ".stale"), ignore_errors=True)
                run.rename(stale)
            pending.append((run, cmd, f"[{done}/{total}] {name} seed {seed}: {' '.join(cmd[3:])}"))
    running: list[tuple[Path, subprocess.Popen, float, Any]] = []
    left = 0
    try:
        while pending or running:
            if pending and stop.exists():
                left = len(pending)
                log(f"{stop} found: starting none of the {left} runs left, letting the {len(running)} running finish")
                pending.clear()
            while pending and len(running) < max(1, jobs):
                run, cmd, line = pending.pop(0)
                log(line)
                env = {**os.environ, "HF_HUB_OFFLINE": "1"}
                if "--resume" not in cmd:  # new (a stale one was set aside above): held for the run it starts
                    claim_run_folder(run, has_checkpoint=False)
                    env[LOCK_ENV] = str(run.resolve())
                err = open(run / "compare_stderr.log", "w")  # closed by _finish
                proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                        preexec_fn=die_with_parent)  # noqa: PLW1509 (it dies with this process)
                running.append((run, proc, time.perf_counter(), err))
            time.sleep(0.2)
            for item in [r for r in running if r[1].poll() is not None]:
                running.remove(item)
                _finish(*item)
                if spec.prune_checkpoints:  # finished: its metrics and eval stay, its ~2 GB of checkpoints go
                    shutil.rmtree(item[0] / "checkpoints", ignore_errors=True)
        if stop.exists():
            stop.unlink()  # honoured, or too late to matter: either way the next call carries on
            log(f"stopped by {stop} (removed): {left} runs left for the next call" if left else
                f"removed {stop}: it came after the last run had started")
    finally:
        for run, proc, _, err in running:  # interrupted: stop the runs; their checkpoints let the next call resume
            stop_child(proc)  # ended before its folder's lock is let go
            err.close()
            unlock_run(run)


def _check_same_run(spec: Spec, run: Path, overrides: list[str]) -> None:
    """A run found in --out (finished, or to resume) must be the one the spec gives: another run copied or left
    there would be reported as this config's, or resumed with plugins the user never named."""
    want = load_config(spec.base, overrides, trust_plugins=spec.trust_plugins, task_check=task_args_problems)
    differs = run_differs(run / "config.yaml", want)
    if differs:
        shown = ", ".join(f"{k} {a!r} (the spec: {b!r})" for k, (a, b) in list(differs.items())[:4])
        raise EmapgError(f"{run}: holds a run that is not the spec's ({shown}{', ...' if len(differs) > 4 else ''}): "
                         "move it away or pick another --out (nothing was started)")


def _finish(run: Path, proc: subprocess.Popen, t0: float, err) -> None:
    seconds = time.perf_counter() - t0
    err.close()
    unlock_run(run)
    if proc.returncode != 0:
        tail = (run / "compare_stderr.log").read_text()[-3000:]
        raise EmapgError(f"run {run} failed (exit {proc.returncode}):\n{tail}")
    prev = json.loads((run / "compute.json").read_text()) if (run / "compute.json").exists() else {}
    here = machine_and_code()
    ran_on = [*prev.get("ran_on", []), *([here] if here not in prev.get("ran_on", []) else [])]
    (run / "compute.json").write_text(json.dumps({"seconds": prev.get("seconds", 0) + seconds, "ran_on": ran_on}))


def machine_and_code() -> dict[str, Any]:
    """What a run's numbers depend on besides its config: the commit of the emapg code that ran it (with
    ``+dirty`` when its src/ had uncommitted changes; None outside a git checkout), torch's version and the
    CPU's model name and flags that decide its kernels (AVX-512, AMX, BF16)."""
    src = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
        dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--", "."], capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, ""
    flags = distributed.cpu_flags()
    return {"commit": None if commit is None else commit + ("+dirty" if dirty else ""), "torch": torch.__version__,
            "cpu": distributed.cpu_model(), "cpu_flags": [f for f in distributed.KERNEL_FLAGS if f in flags],
            "cores": os.cpu_count()}
