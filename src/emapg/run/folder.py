"""Run folders: where ``emapg train`` may write, and what a resume may change (provenance).

A folder emapg starts a run in is new or empty; emapg marks it (``.emapg-run``) so that a run that
stopped before its first checkpoint can be started again in the same folder, while a folder of
the user's own files is never written into. Every resume appends what it changed to
``resumes.jsonl`` and rewrites ``config.yaml`` (atomically) to the configuration now in force;
a change that alters what the resumed steps replay (the seed, the algorithm, the data, the model)
is refused unless ``--force`` is given.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import yaml

from emapg.atomic import append_line, open_lock, write_json_atomic
from emapg.backends import BACKENDS
from emapg.config import RUN_MARKER, ConfigError, TrainConfig, load_config, replay_safe, save_config, to_dict
from emapg.run.metrics import PLOTS

MARKER = RUN_MARKER  # what makes a folder a run folder (a config inside one brings no plugin without trust)
LOCK = ".emapg.lock"  # the one writer's OS lock (and its PID, for the message a second writer gets)
LOCK_ENV = "EMAPG_RUN_LOCK"  # set by a launcher holding the lock for the processes it starts (--nproc)
LAUNCHER_ENV = "EMAPG_LAUNCHER_PID"  # that launcher's PID: its workers' grandparent (torchrun in between)
RESUME_ENV = "EMAPG_RESUME_WITH"  # the command that continues the run, for torchrun's wrapper to say (--nproc)
_HELD: dict[Path, IO] = {}
# What a run writes into its folder (removed when a run that never checkpointed starts again;
# anything else there, such as emapg compare's log of the run, stays); a rollout engine's files are in a
# folder named for its backend (:func:`run_files`).
RUN_FILES = ("config.yaml", "metrics.jsonl", "resumes.jsonl", "tensorboard", "checkpoints", "export",
             "eval.json", "eval.md", "finished.json", "wandb", "wandb_id", *(f"{name}.png" for name in PLOTS))


def run_files() -> set[str]:
    """:data:`RUN_FILES` and each registered backend's folder (a plugin's too, once its config imported it)."""
    return {*RUN_FILES, *(name for name, b in BACKENDS.items() if b.for_run is not None)}


def lock_run(run_dir: Path) -> None:
    """Make this process the run folder's one writer until :func:`unlock_run` or its exit: an exclusive OS lock
    on ``RUN/.emapg.lock``, which the OS releases when the process ends, however it ends (a killed run leaves
    no stale lock). A second writer gets a ConfigError naming the holder's PID, before it writes anything.
    Re-entrant within a process; a process started by a holder (``EMAPG_RUN_LOCK`` names the folder) writes
    under its lock. Once held, the temporary files an earlier, killed writer left (``.NAME.tmp-PID``) are
    removed."""
    key = Path(run_dir).resolve()
    if _held_here(key):
        return
    key.mkdir(parents=True, exist_ok=True)
    f = open_lock(key / LOCK)  # held open for the process's life
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise _busy(run_dir, holder) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    _HELD[key] = f
    for debris in [*key.glob(".*.tmp-*"), *key.glob("checkpoints/.*.tmp-*")]:  # files a killed writer left
        if debris.is_file():
            debris.unlink()


def die_with_parent(grandparent: int | None = None) -> None:
    """Ask the OS to send this process SIGTERM when its parent ends (Linux's PR_SET_PDEATHSIG): a process that
    writes under its launcher's lock never outlives it, however the launcher ends (SIGKILL too). For
    ``subprocess``'s ``preexec_fn`` and for a launched worker itself; nothing on other systems.

    The request covers only what happens after it: a parent (or, for a torchrun worker, the launcher
    ``grandparent`` above torchrun) that ended before it leaves this process adopted by init or by a
    subreaper, which the parent's PID no longer being the one expected shows; then it ends now."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    parent = os.getppid()
    orphaned = parent == 1 or (grandparent is not None and _parent_of(parent) != grandparent)
    if orphaned:  # the parent (or the launcher above it) ended before the request: end now, as it would have
        os.kill(os.getpid(), signal.SIGTERM)


def _parent_of(pid: int) -> int | None:
    """The parent PID of process ``pid`` (Linux's /proc), None when it is gone or unreadable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # after "(comm)": state, then the parent's PID


def stop_child(proc) -> None:
    """Stop a child process that writes under this process's lock, and wait for it to end (SIGTERM, then
    SIGKILL after 60 s), so the lock is released only when nothing writes under it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def unlock_run(run_dir: Path) -> None:
    """Let go of ``run_dir``'s lock if this process holds it (a command's end; the process's end does it too)."""
    f = _HELD.pop(Path(run_dir).resolve(), None)
    if f is not None:
        f.close()


def _busy(run_dir: Path, holder: str) -> ConfigError:
    return ConfigError(f"{run_dir}: another emapg process (PID {holder}) is writing this run folder; wait for it "
                       "to end, or pick another folder (nothing was changed)")


def _held_here(key: Path) -> bool:
    """Whether this process holds the lock of the resolved folder ``key``, itself or through its launcher."""
    return key in _HELD or os.environ.get(LOCK_ENV) == str(key)


def check_not_busy(run_dir: Path) -> None:
    """Raise the second writer's ConfigError if another process holds ``run_dir``'s lock; changes nothing
    (a shared lock tried and let go)."""
    path = Path(run_dir) / LOCK
    if not path.is_file() or _held_here(path.parent.resolve()):
        return
    with open(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _busy(run_dir, f.read().strip() or "unknown") from None
        fcntl.flock(f, fcntl.LOCK_UN)


def claim_run_folder(run_dir: Path, has_checkpoint: bool) -> None:
    """Make ``run_dir`` ready for a fresh run, holding its lock (:func:`lock_run`), or raise ConfigError
    without touching it."""
    run_dir = Path(run_dir)
    check_not_busy(run_dir)
    if has_checkpoint:
        raise ConfigError(f"--out {run_dir}: already holds a run with checkpoints; continue it with --resume "
                          f"{run_dir}, or pick another --out (nothing was changed)")
    entries = sorted(p.name for p in run_dir.iterdir() if p.name != LOCK) if run_dir.is_dir() else []
    if entries and MARKER not in entries:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise ConfigError(f"--out {run_dir}: holds files emapg did not write ({shown}); a run starts only in a "
                          "new or empty folder (nothing was changed)")
    lock_run(run_dir)  # before anything is removed: a run still writing here keeps its files
    left = [name for name in entries if name in run_files()]
    if left:  # one of ours that stopped before its first checkpoint: nothing in it can be resumed
        print(f"emapg: {run_dir} holds a run that stopped before its first checkpoint: starting it again",
              file=sys.stderr)
        for name in left:
            path = run_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / MARKER).write_text("a run folder of emapg train\n")


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and key != "task_args":
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def run_differs(cfg_file: Path, cfg: TrainConfig) -> dict[str, list[Any]]:
    """The fields, not a resume's to change (``replay_safe``), where a run's config.yaml differs from ``cfg``,
    as ``{field: [the run's, cfg's]}``; read as plain YAML (its plugins not imported). A file that is not a
    run's config differs as a whole (``config.yaml``)."""
    try:
        data = yaml.safe_load(Path(cfg_file).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        data = None
    if not isinstance(data, dict):
        return {"config.yaml": [data, "a run's settings"]}
    have, want = _flat(data), _flat(to_dict(cfg))
    # a field the run's file does not name came after the emapg that wrote it: its default is what the run ran
    return {k: [have[k], v] for k, v in want.items() if k in have and have[k] != v and not replay_safe(k)}


@dataclass
class ResumeChange:
    """A resume's changes to its run's config, checked; written (:meth:`record`) only once the run is known to
    start (its model and checkpoint loaded), so a resume that fails leaves config.yaml and resumes.jsonl alone."""

    run_dir: Path
    cfg_file: Path
    cfg: TrainConfig
    overrides: list[str]
    changed: dict[str, list[Any]]
    forced: bool

    def record(self) -> None:
        if self.changed:
            log_resume(self.run_dir, self.overrides, self.changed, forced=self.forced)
            save_config(self.cfg, self.cfg_file)


def check_resume(run_dir: Path, cfg_file: Path, cfg: TrainConfig, overrides: list[str], force: bool) -> ResumeChange:
    """A resume's overrides against the run's config. Raises ConfigError (nothing written) for changes that
    alter the replay, unless ``force``."""
    # (the user's trust in its plugins was asked when the resume loaded it: the same file, read again)
    before, after = _flat(to_dict(load_config(cfg_file, trust_plugins=True))), _flat(to_dict(cfg))
    changed = {k: [before.get(k), after[k]] for k in after if before.get(k) != after[k]}
    unsafe = [k for k in changed if not replay_safe(k)]  # the schema's replay_safe fields
    if unsafe and not force:
        listed = ", ".join(f"{k} {changed[k][0]!r} -> {changed[k][1]!r}" for k in unsafe)
        raise ConfigError(f"--resume {run_dir}: {listed} would change what the resumed steps replay; pass --force "
                          "to accept (it is recorded in resumes.jsonl), or start a new run (nothing was changed)")
    return ResumeChange(run_dir, cfg_file, cfg, list(overrides), changed, bool(unsafe))


FINISHED = "finished.json"  # the run's end (export, evaluation table, plots) done, at its step


def mark_finished(run_dir: Path, step: int) -> None:
    write_json_atomic(Path(run_dir) / FINISHED, {"step": step})


def run_finished(run_dir: Path, step: int) -> bool:
    """Whether the run's end (export, evaluation table, plots) completed at ``step``. A run folder written
    before emapg kept the mark counts as finished when it holds eval.json."""
    mark = Path(run_dir) / FINISHED
    if not mark.exists():
        return (Path(run_dir) / "eval.json").exists()
    try:
        return json.loads(mark.read_text()).get("step") == step
    except (ValueError, AttributeError, UnicodeDecodeError):
        return False


def log_resume(run_dir: Path, overrides: list[str], changed: dict[str, list[Any]], forced: bool) -> None:
    """Append one resume's changes to the run's ``resumes.jsonl``."""
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "overrides": overrides, "changed": changed, "forced": forced}
    append_line(Path(run_dir) / "resumes.jsonl", json.dumps(entry))


def check_teacher(run_dir: Path, name: str, recorded: str | None, now: str, force: bool, main: bool) -> None:
    """A resumed distillation run's teacher against the one its checkpoint was trained with (sha256 of
    its weights): a teacher retrained or replaced in place would change the resumed steps silently.
    Raises ConfigError unless ``force``; a forced change is recorded in ``resumes.jsonl`` (by ``main``).
    A checkpoint without a record (written before emapg kept one) is not checked."""
    if recorded is None or recorded == now:
        return
    if not force:
        raise ConfigError(f"--resume {run_dir}: algo.teacher {name!r} has other weights than the teacher this "
                          f"run was trained with (sha256 {now[:12]}... now, {recorded[:12]}... in its checkpoint), "
                          "which would change what the resumed steps replay; pass --force to accept (it is "
                          "recorded in resumes.jsonl), or start a new run")
    if main:
        log_resume(run_dir, [], {"teacher_sha256": [recorded, now]}, forced=True)
