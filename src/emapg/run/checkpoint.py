"""Checkpoints: safetensors + JSON only, written atomically; a training run's save, resume and export.

Layout of ``RUN/checkpoints``::

    step_000020/            one complete checkpoint
        policy.safetensors  anchor.safetensors  optimizer.safetensors  state.json
        weight_ema.safetensors    (a run whose weight_ema keeps its own copy)
    latest                  text file naming the newest complete checkpoint

A checkpoint is written into a temporary folder, flushed to disk, then renamed into place (an
atomic operation on POSIX); only then is ``latest`` replaced, also by an atomic rename. A kill at
any moment leaves either the previous checkpoint or the new one as ``latest``, never a broken one;
a kill between the two renames leaves a complete first checkpoint and no ``latest`` yet, which
``latest_checkpoint`` then finds by itself.

The tensor files hold whole tensors whatever the number of processes (any number resumes any checkpoint),
but under FSDP2 no rank gathers them: each writes its own rows in place and reads back only its own rows
(:mod:`emapg.run.shards`), so a rank's memory at save and resume is its shard's.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from emapg.atomic import OLD, TMP, folder_atomic, fsync_dir, is_ours, write_json_atomic
from emapg.errors import CheckpointError, ConfigError
from emapg.models import distributed
from emapg.models.lm import non_finite, tied_names
from emapg.run import shards

LATEST = "latest"


def optimizer_tensors(state_dict: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split an optimizer state dict into tensors (for safetensors) and JSON (the rest).

    The state is keyed by parameter (a name, or an index for a bare optimizer); tensors are stored
    as ``<param>.<field>`` (parameter names contain dots, field names do not).
    """
    tensors, scalars = {}, {}
    for param, st in state_dict["state"].items():
        for name, value in st.items():
            if torch.is_tensor(value):
                tensors[f"{param}.{name}"] = value
            else:
                scalars[f"{param}.{name}"] = value
    return tensors, {"param_groups": state_dict["param_groups"], "scalars": scalars}


def optimizer_state_dict(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`optimizer_tensors`."""
    state: dict[Any, dict[str, Any]] = {}
    for key, value in list(tensors.items()) + list(meta["scalars"].items()):
        param, name = key.rsplit(".", 1)
        state.setdefault(int(param) if param.isdigit() else param, {})[name] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def save_checkpoint(
    ckpt_dir: Path,
    step: int,
    policy_state: Mapping[str, torch.Tensor],
    anchor_state: Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | dict[str, Any],
    state: dict[str, Any],
    keep: int = 2,
    main: bool = True,
    extra: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
    keep_every: int = 0,
) -> Path:
    """Write checkpoint ``step`` atomically and point ``latest`` at it; prune old ones.

    ``optimizer``: an optimizer, or its state dict (name-keyed, as the trainer saves it). ``extra``: more tensor
    files, {name: tensors} written as ``name.safetensors`` (a weight EMA's). Tensors may be
    DTensors sharded on dim 0: then this is collective, every rank writes its rows and rank 0 (``main``)
    the rest (the headers, whole tensors, state.json, ``latest``)."""
    final = ckpt_dir / f"step_{step:06d}"
    opt_sd = optimizer if isinstance(optimizer, dict) else optimizer.state_dict()
    opt_tensors, opt_meta = optimizer_tensors(opt_sd)
    files = {f"{name}.safetensors": shards.pieces(tensors, main) for name, tensors in
             (("policy", policy_state), ("anchor", anchor_state), ("optimizer", opt_tensors),
              *(extra or {}).items())}
    with _shared_folder(final, main) as tmp:  # re-saving a step (after a resume) replaces it only when complete
        if main:
            for name, parts in files.items():
                shards.create(tmp / name, parts)
        distributed.barrier()
        for name, parts in files.items():
            shards.write_rows(tmp / name, parts)
        distributed.barrier()
        if main:
            with open(tmp / "state.json", "w") as f:
                json.dump({"step": step, "optimizer": opt_meta, **state}, f, indent=1)
    if main:
        write_json_atomic(ckpt_dir / LATEST, {"checkpoint": final.name, "step": step})
        fsync_dir(ckpt_dir)
        _prune(ckpt_dir, keep, step, keep_every)
    distributed.barrier()
    return final


@contextlib.contextmanager
def _shared_folder(final: Path, main: bool) -> Iterator[Path]:
    """:func:`folder_atomic` on rank 0; every rank gets its temporary folder's path to write into."""
    if not main:
        yield Path(distributed.all_gather_objects(None)[0])
        return
    with folder_atomic(final) as tmp:
        distributed.all_gather_objects(str(tmp))
        yield tmp


STEP_DIR = re.compile(r"step_(\d+)")  # a checkpoint folder's name, exactly (a backup "step_000004.bak" is not one)


def _step_of(path: Path) -> int:
    return int(STEP_DIR.fullmatch(path.name).group(1))


def check_no_link_out(run_dir: Path) -> None:
    """Refuse (one line, nothing changed) a run folder holding a link that leads out of it: at its top, or inside
    the folders emapg writes (``export*/``, ``outcomes/``, ``tensorboard/``; an export, outcomes or a file linked
    to another run's): a resume would write into, replace or append to that run's files. ``checkpoints/`` has
    its own rule (:func:`checkpoints_of`: a linked ``step_N`` is passed over, said); the folders of other tools
    (``wandb/`` links its logs to its cache) are theirs."""
    if not run_dir.is_dir():
        return
    real = run_dir.resolve()
    for top in run_dir.iterdir():
        if top.name == "checkpoints":
            continue
        ours = top.is_dir() and not top.is_symlink() and (top.name in ("outcomes", "tensorboard")
                                                          or top.name.startswith("export"))
        for path in [top, *(top.rglob("*") if ours else [])]:  # rglob does not enter linked folders
            if path.is_symlink() and not path.resolve().is_relative_to(real):
                raise CheckpointError(f"{path} leads out of the run folder, to {path.resolve()}: a run writes only "
                                      "inside its own folder (remove the link; nothing was changed)")


def checkpoints_of(run_dir: Path) -> Path:
    """``RUN/checkpoints``, checked before a resume reads it or a save writes and prunes it: refused (one line,
    nothing changed) when it leads out of the run's real folder (a symlink to another run's: a resume would
    prune that run's checkpoints and repoint its ``latest``), or when its ``latest`` is not a file."""
    ckpt_dir = Path(run_dir) / "checkpoints"
    check_no_link_out(Path(run_dir))
    if ckpt_dir.is_symlink() or ckpt_dir.exists():
        real, run = ckpt_dir.resolve(), Path(run_dir).resolve()
        if not real.is_relative_to(run):
            raise CheckpointError(f"{ckpt_dir} leads out of the run folder, to {real}: emapg reads, writes and prunes "
                                  "only a run's own checkpoints (remove the link; nothing was changed)")
        latest = ckpt_dir / LATEST
        if latest.is_symlink() or latest.is_dir():  # every later save's rename onto it would fail (a FIFO: damaged)
            kind = "link" if latest.is_symlink() else "folder"
            raise CheckpointError(f"{latest} is not emapg's pointer file (a {kind}): move it away; nothing was changed")
    return ckpt_dir


def _step_dirs(ckpt_dir: Path, warn: bool = False) -> list[Path]:
    """The checkpoint folders of ``ckpt_dir`` (names ``step_N``; anything else there is not one), by step. A
    ``step_N`` that leads out of ``ckpt_dir`` (a link to another run's) is none of this run's: never resumed nor
    pruned (``warn``: said)."""
    found, real = [], ckpt_dir.resolve()
    for p in ckpt_dir.glob("step_*"):
        if not (STEP_DIR.fullmatch(p.name) and p.is_dir()):
            continue
        if p.is_symlink() or not p.resolve().is_relative_to(real):
            if warn:
                print(f"emapg: warning: {p} leads out of the run folder, to {p.resolve()}: not this run's "
                      "checkpoint (not resumed, not pruned)", file=sys.stderr)
            continue
        found.append(p)
    return sorted(found, key=_step_of)


def _prune(ckpt_dir: Path, keep: int, current: int, keep_every: int = 0) -> None:
    """Keep the ``keep`` newest checkpoints up to ``current`` (which ``latest`` names), and those whose step is a
    multiple of ``keep_every`` (0: none). Folders of later steps belong to a future this run abandoned by resuming
    from an earlier checkpoint: remove them."""
    done = _step_dirs(ckpt_dir)
    for p in done:
        if _step_of(p) > current:
            shutil.rmtree(p, ignore_errors=True)
    kept = [p for p in done if _step_of(p) <= current]
    for p in kept[:-keep]:
        if not (keep_every and _step_of(p) % keep_every == 0):
            shutil.rmtree(p, ignore_errors=True)
    for stale in list(ckpt_dir.glob(f".step_*{TMP}*")) + list(ckpt_dir.glob(f".step_*{OLD}*")):  # killed saves
        if not is_ours(stale):
            shutil.rmtree(stale, ignore_errors=True)


def _complete(ckpt_dir: Path, warn: bool = False) -> list[Path]:
    """Complete checkpoint folders (state.json is written last, before the atomic rename), oldest first."""
    return [p for p in _step_dirs(ckpt_dir, warn) if (p / "state.json").exists()]


def latest_checkpoint(run_dir: Path) -> Path:
    """The newest complete checkpoint of a run folder; raise FileNotFoundError naming what is missing.

    ``latest`` decides; without it (a kill between a first checkpoint's rename and ``latest``), the
    newest complete step folder."""
    ckpt_dir = checkpoints_of(run_dir)
    pointer = ckpt_dir / LATEST
    if not pointer.exists():
        found = _complete(ckpt_dir) if ckpt_dir.is_dir() else []
        if found:
            return found[-1]
        raise FileNotFoundError(f"--resume {run_dir}: no checkpoint found ({pointer} does not exist)")
    try:
        if not pointer.is_file():  # a FIFO or a device would be read for ever
            raise ValueError("not a regular file")
        name = json.loads(pointer.read_text())["checkpoint"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{pointer} is damaged ({type(e).__name__}: {e})") from None
    if not isinstance(name, str) or not STEP_DIR.fullmatch(name):  # never a path out of this folder
        raise CheckpointError(f"{pointer} is damaged: it names {name!r}, not a checkpoint folder of this run "
                              "(step_N)")
    path = ckpt_dir / name
    if path.is_symlink() or not path.resolve().is_relative_to(ckpt_dir.resolve()):
        raise CheckpointError(f"{pointer} names {name}, which leads out of the run folder, to {path.resolve()}: "
                              "not this run's checkpoint")
    if not (path / "state.json").exists():
        raise FileNotFoundError(f"--resume {run_dir}: {pointer} names {name}, which is incomplete or missing")
    return path


def resume_candidates(run_dir: Path) -> list[Path]:
    """Checkpoints to resume from, best first: the one ``latest`` names (if it is readable), then every
    other complete one, newest first."""
    ckpt_dir = checkpoints_of(run_dir)
    found = list(reversed(_complete(ckpt_dir, warn=True))) if ckpt_dir.is_dir() else []
    try:
        first = latest_checkpoint(run_dir)
    except (FileNotFoundError, CheckpointError):
        return found
    return [first] + [p for p in found if p != first]


def resume_step(run_dir: Path) -> int | None:
    """The step a resume of ``run_dir`` would most likely start from (its best candidate's folder name;
    a damaged one falls back further when read), or None without a checkpoint."""
    found = resume_candidates(run_dir)
    return _step_of(found[0]) if found else None


def has_checkpoint(run_dir: Path) -> bool:
    """Whether the run folder holds a complete checkpoint to resume from."""
    return bool(resume_candidates(run_dir))


STATE_KEYS = ("step", "optimizer")  # what save_checkpoint itself writes; the trainer checks its own


def _read_state(path: Path) -> dict[str, Any]:
    file = path / "state.json"
    if file.exists() and not file.is_file():  # a FIFO or a device would be read for ever
        raise CheckpointError(f"{file} is damaged: not a regular file")
    try:
        state = json.loads(file.read_text())
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is damaged ({type(e).__name__}: {e})") from None
    missing = [k for k in STATE_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointError(f"{file} is damaged: no {', '.join(missing)}")
    step = state["step"]
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{file} is damaged: step {step!r} is not a whole number >= 0")
    opt = state["optimizer"]
    if not (isinstance(opt, dict) and isinstance(opt.get("param_groups"), list) and opt["param_groups"]
            and all(isinstance(g, dict) and isinstance(g.get("params"), list) and g["params"]
                    for g in opt["param_groups"]) and isinstance(opt.get("scalars", {}), dict)):
        raise CheckpointError(f"{file} is damaged: its optimizer is {opt!r:.80}, not {{param_groups: [{{params: "
                              "[...], ...}}, ...], scalars: {...}}")
    if path.name[len("step_"):].isdigit() and _step_of(path) != step:
        raise CheckpointError(f"{file} is damaged: it says step {step}, its folder is {path.name}")
    return state


def _read_tensors(file: Path) -> shards.Tensors:
    try:
        return shards.Tensors(file)
    except Exception as e:  # safetensors raises its own error types for truncated or garbage files
        raise CheckpointError(f"{file} is damaged ({type(e).__name__}: {e})") from None


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Open a checkpoint folder: {'policy', 'anchor', 'optimizer': (tensors, meta), 'state'}; the tensors are
    read when asked (whole, or a rank's rows: :class:`emapg.run.shards.Tensors`). Raises
    :class:`CheckpointError` naming the damaged file (a header that does not fit its file, garbage JSON)."""
    state = _read_state(path)
    out = {
        "policy": _read_tensors(path / "policy.safetensors"),
        "anchor": _read_tensors(path / "anchor.safetensors"),
        "optimizer": (_read_tensors(path / "optimizer.safetensors"), state.pop("optimizer")),
        "state": state,
    }
    ema_file = path / f"{WEIGHT_EMA}.safetensors"
    if ema_file.exists() or state.get(WEIGHT_EMA):  # state.json says whether it wrote one: missing is damaged
        out[WEIGHT_EMA] = _read_tensors(ema_file)
    return out


WEIGHT_EMA = "weight_ema"  # a checkpoint's file of the weight EMA, where it has its own copy


# ---- a training run's checkpoints ----------------------------------------------------------------------

RUN_STATE_KEYS = ("skipped_steps", "scheduler")  # what the trainer's state.json must hold to resume


def _whole(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


# each key of the trainer's state.json: (its check, what it must be); the optional ones are checked when present
RUN_STATE_TYPES = {
    "skipped_steps": (_whole, "a whole number >= 0"),
    "scheduler": (lambda v: isinstance(v, dict) and _whole(v.get("last_epoch")), "the schedule's state"),
    "initial_eval": (lambda v: v is None or isinstance(v, dict), "an evaluation's result or null"),
    "initial_eval_settings": (lambda v: v is None or isinstance(v, dict | list), "evaluation settings or null"),
    "anchor_is_initial": (lambda v: isinstance(v, bool), "true or false"),
    "seed": (lambda v: isinstance(v, int) and not isinstance(v, bool), "a whole number"),
    "world": (lambda v: _whole(v) and v >= 1, "a whole number >= 1"),
    "teacher_sha256": (lambda v: v is None or isinstance(v, str), "a digest or null"),
    "weight_ema": (lambda v: isinstance(v, bool), "true or false"),
}


def run_state_problem(state: dict[str, Any]) -> str | None:
    """What is wrong with a trainer's state.json (a key missing, or of the wrong type), or None."""
    absent = [k for k in RUN_STATE_KEYS if k not in state]
    if absent:
        return f"no {', '.join(absent)}"
    for key, (ok, want) in RUN_STATE_TYPES.items():
        if key in state and not ok(state[key]):
            return f"{key} is {state[key]!r}, expected {want}"
    return None


def _other_model(ckpt: dict[str, Any], names: Mapping[str, list[int]] | set[str], known: set[str]) -> str | None:
    """How a readable checkpoint's policy differs from the model's (``names``: the tensors it must hold, with
    their shapes when a mapping; ``known``: every name the model has, a tied head's too): another model's names
    (some missing, others there instead) or another shape of a name both have; None when it fits or is only
    short of names (a damaged file)."""
    policy = ckpt["policy"]
    missing, foreign = sorted(set(names) - set(policy)), sorted(set(policy) - known)
    if foreign:  # a damaged file loses tensors, it never gains some
        return f"another model's weights ({foreign[0]}, which this run's model has not" + (
            f"; no {missing[0]})" if missing else ")")
    if isinstance(names, Mapping):
        for name in sorted(set(names) & set(policy)):
            if list(policy.shape(name)) != list(names[name]):
                return (f"weights of another shape ({name} is {list(policy.shape(name))} there, {list(names[name])} "
                        "in this run's model: another size of the model?)")
    return None


def _optimizer_problem(ckpt: dict[str, Any], known: set[str]) -> str | None:
    """What is wrong with the names a checkpoint's optimizer state gives its parameters (one the model has not,
    or one twice: Adam then met a tensor of another size at the first step), or None."""
    listed = [p for group in ckpt["optimizer"][1]["param_groups"] for p in group["params"]]
    strange = [p for p in listed if not isinstance(p, str) or p not in known]
    if strange:
        return f"its optimizer names {strange[0]!r}, which this run's model has not"
    if len(set(listed)) < len(listed):
        return "its optimizer names a parameter twice"
    return None


def intact_checkpoint(run_dir: Path, names: Mapping[str, list[int]] | set[str], warn: bool = True,
                      what: str = "--resume", known: set[str] | None = None) -> dict[str, Any]:
    """The contents of the newest checkpoint of the run folder that reads whole and holds every policy
    tensor in ``names`` (with its shape, when a mapping). A damaged one (a truncated tensor file, garbage JSON,
    a missing key) is named in a warning and skipped; none intact is a CheckpointError naming every damaged
    file. A ``latest`` that names a missing or incomplete checkpoint, or cannot be read, is named in a warning
    too. A checkpoint of another model (other names, other shapes) is not damaged: it is refused at once,
    saying so."""
    damaged = []
    if warn and (Path(run_dir) / "checkpoints" / LATEST).exists():
        try:
            latest_checkpoint(run_dir)
        except (FileNotFoundError, CheckpointError) as e:
            print(f"emapg: warning: {e}; looking for the newest complete checkpoint instead", file=sys.stderr)
    for path in resume_candidates(run_dir):
        try:
            ckpt = load_checkpoint(path)
            other = _other_model(ckpt, names, set(names) if known is None else known)
            if other:
                raise ConfigError(f"{what} {run_dir}: {path.name} holds {other}: it needs a run of this run's "
                                  "model, as config.yaml's model and lora settings build it")
            missing = sorted(set(names) - set(ckpt["policy"]))
            if missing:
                raise CheckpointError(f"{path / 'policy.safetensors'} is damaged: no {', '.join(missing[:3])}")
            problem = run_state_problem(ckpt["state"]) or _optimizer_problem(ckpt, known or set(names))
            if problem:
                raise CheckpointError(f"{path / 'state.json'} is damaged: {problem}")
        except CheckpointError as e:
            damaged.append(str(e))
            if warn:
                print(f"emapg: warning: {e}; trying an older checkpoint", file=sys.stderr)
            continue
        if damaged and warn:
            print(f"emapg: warning: resuming from {path} (step {ckpt['state']['step']})", file=sys.stderr)
        return ckpt
    why = "; ".join(damaged) if damaged else "the run folder holds no checkpoint"
    purpose = "resume" if what == "--resume" else "start from"
    raise CheckpointError(f"{what} {run_dir}: no intact checkpoint to {purpose} ({why})")


def starting_checkpoint(run_dir: Path, names: Mapping[str, list[int]] | set[str], steps: int, warn: bool = True,
                        known: set[str] | None = None) -> dict[str, Any]:
    """``init_from``: the newest intact checkpoint of another run folder, which a new run starts from and
    trains on to ``steps`` (a checkpoint at or past it is refused: nothing would train)."""
    if not Path(run_dir).is_dir():
        raise CheckpointError(f"init_from: {run_dir} is not a run folder")
    ckpt = intact_checkpoint(Path(run_dir), names, warn=warn, what="init_from:", known=known)
    if ckpt["state"]["step"] >= steps:
        raise CheckpointError(f"steps: {steps} is not past step {ckpt['state']['step']} of init_from {run_dir}, "
                              "where this run starts: nothing to train (give a larger steps=)")
    return ckpt


def restore_training(ckpt: dict[str, Any], model: nn.Module, anchor, optimizer: torch.optim.Optimizer, cfg,
                     sharded: bool, weight_ema=None, warn: bool = True) -> dict[str, Any]:
    """Load a checkpoint's policy, anchor, weight EMA and optimizer state into the run's objects (sharded: into
    FSDP2's shards); returns its state.json (step, scheduler, ...). The optimizer's settings are the run's
    config's (lr, betas, weight decay), not the checkpoint's: a later stage may change them. A weight EMA the
    checkpoint does not hold (``init_from`` a run without one) starts at the checkpoint's policy, said."""
    missing, unexpected = load_policy(model, ckpt["policy"])
    if missing or unexpected:
        raise CheckpointError(f"checkpoint does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    odd = non_finite(model)  # this rank's rows: every rank votes, then all say it
    if not distributed.all_agree(not odd):
        named = next((o[0] for o in distributed.all_gather_objects(odd) if o), "a parameter")
        step = ckpt["state"]["step"]
        raise CheckpointError(f"the checkpoint at step {step} (step_{step:06d}) holds weights that are not finite "
                              f"({named} holds NaN or infinity): the run diverged before it was saved, or the file "
                              "is damaged; remove that checkpoint folder to resume from the one before it")
    anchor_file, layout = ckpt["anchor"], anchor.layout()
    anchor.load_state_dict(shards.Rows(anchor_file, lambda n: anchor_file.local(n, layout[n])), local=True)
    if weight_ema is not None and WEIGHT_EMA in ckpt:
        ema_file, ema_layout = ckpt[WEIGHT_EMA], weight_ema.layout()
        weight_ema.load_state_dict(shards.Rows(ema_file, lambda n: ema_file.local(n, ema_layout[n])), local=True)
    elif weight_ema is not None:
        weight_ema.reset_to(model)
        if warn:
            print(f"emapg: the checkpoint at step {ckpt['state']['step']} holds no weight EMA: weight_ema starts at "
                  "its policy", file=sys.stderr)
    tensors, meta = ckpt["optimizer"]
    params = dict(model.named_parameters())
    distributed.load_optimizer_state(model, optimizer, optimizer_state_dict(
        shards.Rows(tensors, lambda k: _param_rows(tensors, k, params.get(k.rsplit(".", 1)[0]))), meta),
        sharded=sharded)
    for group in optimizer.param_groups:
        group.update(lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    return ckpt["state"]


def load_policy(model: nn.Module, policy: shards.Tensors) -> tuple[list[str], list[str]]:
    """Copy a checkpoint's policy tensors into ``model`` one at a time, each rank its own rows only (a plain
    model's are whole): no second copy of the model. Returns the names that do not fit, (missing, unexpected)
    (a tied head's name may be absent), copying nothing then."""
    tied, targets = tied_names(model), model.state_dict()
    missing = [n for n in targets if n not in policy and n not in tied]
    unexpected = [n for n in policy if n not in targets]
    if not (missing or unexpected):
        with torch.no_grad():
            for name, t in targets.items():
                if name in policy:
                    distributed.local(t).copy_(policy.local(name, t))
    return missing, unexpected


def _param_rows(tensors: shards.Tensors, key: str, param: torch.Tensor | None) -> torch.Tensor:
    """An optimizer state tensor (``<param>.<field>``): the rows this rank holds when it has the parameter's
    shape (exp_avg, exp_avg_sq), as a DTensor laid out like the parameter; else whole (AdamW's step)."""
    if param is not None and tensors.shape(key) == list(param.shape):
        return distributed.as_dtensor(tensors.local(key, param), param)
    return tensors[key]


@dataclass
class Progress:
    """Where a run stands besides its weights: the steps done, the updates dropped as non-finite, and its step-0
    evaluation with the settings it was measured with (the anchor reuses it while it is the initial policy).
    :meth:`state` is what a checkpoint's state.json keeps of it; :meth:`restore` reads it back."""

    step: int = 0
    skipped_steps: int = 0
    initial_eval: dict[str, Any] | None = None
    initial_eval_settings: dict[str, Any] | None = None

    def state(self) -> dict[str, Any]:
        return {"skipped_steps": self.skipped_steps, "initial_eval": self.initial_eval,
                "initial_eval_settings": self.initial_eval_settings}

    def restore(self, state: dict[str, Any], resume: bool) -> None:
        """Take a checkpoint's progress (in place: the learning-rate schedule reads this record); its step-0
        evaluation only on a resume (a run started from another run's checkpoint, ``init_from``, evaluates its
        own start)."""
        self.step, self.skipped_steps = state["step"], state["skipped_steps"]
        if resume:
            self.initial_eval = state.get("initial_eval")
            self.initial_eval_settings = state.get("initial_eval_settings")


def save_training(run_dir: Path, step: int, model: nn.Module, anchor, optimizer: torch.optim.Optimizer,
                  state: dict[str, Any], keep: int, main: bool, weight_ema=None, keep_every: int = 0) -> Path:
    """Checkpoint ``step`` of a run as whole tensors (any number of processes can resume it), with the weight
    EMA's own file where it has its own copy; the newest ``keep`` and every ``keep_every``-th step kept.
    Collective when sharded: every rank writes its own rows (nothing is gathered), rank 0 the rest."""
    opt = distributed.optimizer_state(model, optimizer, whole=False)
    extra = {WEIGHT_EMA: weight_ema.state_dict(gather=False)} if weight_ema is not None else None
    return save_checkpoint(checkpoints_of(run_dir), step, model.state_dict(), anchor.state_dict(gather=False),
                           opt, state, keep=keep, main=main, extra=extra, keep_every=keep_every)
