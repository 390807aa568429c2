"""A run's models as Hugging Face folders (config, tokenizer, safetensors): at the end of a run
(:func:`export_models`), or from any checkpoint afterwards (:func:`export_checkpoint`, ``emapg export``),
whatever number of processes wrote it. Both write ``OUT/policy`` and ``OUT/anchor`` (and ``OUT/ema``, a
``weight_ema`` kept beside a frozen anchor); with LoRA each is exported merged (base + adapters), the anchor and
the EMA with their averaged adapters."""

from __future__ import annotations

import re
from pathlib import Path

from torch import nn

from emapg.anchor import EMAAnchor
from emapg.atomic import folder_atomic
from emapg.config import load_config, run_folder_of
from emapg.models import distributed
from emapg.models.zoo import policy_model, save_hf_folder
from emapg.run.checkpoint import (
    WEIGHT_EMA,
    CheckpointError,
    checkpoints_of,
    load_checkpoint,
    load_policy,
    resume_candidates,
)


def export_models(out: Path, model: nn.Module, anchor, tokenizer, sharded: bool, main: bool, plain_model,
                  weight_ema: EMAAnchor | None = None) -> None:
    """The policy and the anchor as Hugging Face folders ``out/policy`` and ``out/anchor``, and a weight EMA with
    its own copy as ``out/ema``. Sharded, this is collective: rank 0 loads the gathered weights into
    ``plain_model()`` (an unsharded model) and writes."""
    averaged = {"anchor": anchor, **({"ema": weight_ema} if weight_ema is not None else {})}
    if not sharded:
        save_hf_folder(model, tokenizer, out / "policy")
        for name, avg in averaged.items():
            with avg.use(model) as m:
                save_hf_folder(m, tokenizer, out / name)
        return
    states = {"policy": distributed.model_state(model)}
    for name, avg in averaged.items():
        with avg.use(model) as m:
            states[name] = distributed.model_state(m)
    if main:
        plain = plain_model()
        for name, state in states.items():
            plain.load_state_dict(state, strict=False)
            save_hf_folder(plain, tokenizer, out / name)
    distributed.barrier()


def export_checkpoint(run_dir: Path, out: Path | None = None, step: int | None = None,
                      trust_plugins: bool = False) -> Path:
    """Write checkpoint ``step`` of ``run_dir`` (default: its newest intact one) as ``OUT/policy`` and
    ``OUT/anchor``, and ``OUT/ema`` where it holds a weight EMA of its own (default ``OUT``:
    ``RUN/export-step_NNNNNN``), each replaced atomically. The policy is
    built on the CPU from the run's config.yaml (its model and LoRA settings), and the checkpoint's tensors
    loaded into it; the anchor is the policy with the checkpoint's averages in place of its tensors."""
    run_dir = Path(run_dir)
    cfg_file = run_dir / "config.yaml"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{run_dir}: {cfg_file} does not exist (is this a run folder?)")
    cfg = load_config(cfg_file, trust_plugins=trust_plugins, of_run=True)
    path = _checkpoint_folder(run_dir, step)
    ckpt = load_checkpoint(path)
    step = ckpt["state"]["step"]
    model, tokenizer = policy_model(cfg)
    missing, unexpected = load_policy(model, ckpt["policy"])
    if missing or unexpected:
        raise CheckpointError(f"{path / 'policy.safetensors'} does not fit model {cfg.model} of {cfg_file}: missing "
                              f"{missing[:3]}, unexpected {unexpected[:3]}")
    averaged = {"anchor": EMAAnchor(model, eta=cfg.algo.eta, every=cfg.algo.ema_every, module=None)}
    if WEIGHT_EMA in ckpt:  # a weight EMA with its own copy (beside a frozen anchor)
        averaged["ema"] = EMAAnchor(model, eta=1.0, module=None)  # read, never stepped: its decay plays no part
    for name, avg in averaged.items():
        avg.load_state_dict(dict(ckpt[WEIGHT_EMA if name == "ema" else "anchor"]))
    out = Path(out) if out is not None else run_dir / f"export-step_{step:06d}"
    if out.resolve().is_relative_to((run_dir / "checkpoints").resolve()):  # the run's next prune would delete it
        raise CheckpointError(f"--out {out}: inside the run's checkpoints ({run_dir / 'checkpoints'}), which its "
                              "next save prunes; pick a folder outside them (nothing was written)")
    owner = run_folder_of(out / "policy")
    if owner is not None and owner != run_dir.resolve():  # another run's export, or its checkpoints to prune
        raise CheckpointError(f"--out {out}: inside another run's folder ({owner}), whose files its own run "
                              "writes and prunes; pick a folder outside it (nothing was written)")
    for name in ("policy", *averaged):
        check_replaceable(out / name)
    for name in ("policy", *averaged):
        with folder_atomic(out / name) as tmp:
            if name == "policy":
                save_hf_folder(model, tokenizer, tmp)
            else:
                with averaged[name].use(model) as m:
                    save_hf_folder(m, tokenizer, tmp)
    return out


EXPORTED = re.compile(r"config\.json|generation_config\.json|.*\.safetensors|model\.safetensors\.index\.json|"
                      r"tokenizer.*|special_tokens_map\.json|chat_template\.jinja|added_tokens\.json|vocab\.json|"
                      r"merges\.txt")
"""The files a Hugging Face model folder holds (what an export writes)."""


def check_replaceable(folder: Path) -> None:
    """An export replaces ``folder`` whole: only when it is absent, empty, or a model folder holding nothing but a
    model's files (an earlier export); otherwise a CheckpointError names what it would lose (nothing written)."""
    if not folder.exists():
        return
    if not folder.is_dir():
        raise CheckpointError(f"--out: {folder} is a file, not a folder an export may replace (nothing was written)")
    other = sorted(p.name for p in folder.iterdir() if not (p.is_file() and EXPORTED.fullmatch(p.name)))
    if other:
        raise CheckpointError(f"--out: {folder} holds {', '.join(other[:5])}, not a model's files: an export replaces "
                              "the folder whole; pick another --out (nothing was written)")


def _checkpoint_folder(run_dir: Path, step: int | None) -> Path:
    """The checkpoint folder of ``step`` (its name in the error when absent), or the newest complete one."""
    if step is not None:
        path = checkpoints_of(run_dir) / f"step_{step:06d}"
        if path.is_symlink() or (path.exists() and not path.resolve().is_relative_to(run_dir.resolve())):
            raise CheckpointError(f"--step {step}: {path} leads out of the run folder, to {path.resolve()}: not "
                                  "this run's checkpoint (nothing was written)")
        if not (path / "state.json").exists():
            have = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*") if (p / "state.json").exists())
            raise FileNotFoundError(f"--step {step}: {run_dir} has no complete checkpoint {path.name} "
                                    f"(it has: {', '.join(have) or 'none'})")
        return path
    found = resume_candidates(run_dir)
    if not found:
        raise FileNotFoundError(f"{run_dir}: no complete checkpoint in {run_dir / 'checkpoints'}")
    return found[0]
