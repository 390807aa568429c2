"""EMA-PG for TRL users: :class:`EMAPGTrainer`, a ``trl.GRPOTrainer`` whose reference model is an
exponential moving average of the policy and whose KL term is an emapg estimator (extra ``emapg[trl]``).

    trainer = EMAPGTrainer(model, reward_funcs, args=GRPOConfig(..., beta=0.001), train_dataset=ds,
                           eta=0.9, kl="topk_reverse", k=32)

What changes against GRPOTrainer, and nothing else:

* **The reference is an EMA of the policy**, theta_ref <- eta * theta_ref + (1 - eta) * theta, applied
  after the optimizer step every ``ema_every`` optimizer steps. The average is held in fp32 (or the
  parameters' own precision if higher), also for a bf16 policy. With a PEFT model the reference is
  the frozen base plus an EMA of the adapters, kept in a second adapter named ``ref`` (TRL's
  reference pass already runs with an adapter of that name), never a second copy of the base.
* **The per-token KL is emapg's** (:mod:`emapg.kl`), inside TRL's own loss and with its
  aggregation for every ``loss_type``. The head of a top-k estimator is the reference's own top-k
  at each position, found in TRL's reference pass from the hidden states that pass already
  computes (no extra forward pass): any head set chosen without looking at the sampled token keeps
  the unbiased form unbiased. The policy's log-probs at those ids come from its hidden states in
  the loss's own forward, ``log pi(j) = z_j - z_y + log pi(y)`` with z the tempered logits, so only
  k logits per position are formed. Off-policy samples (``num_iterations > 1``, vLLM) get the
  importance weight s = pi / pi_old (pi_samp under vLLM's correction).
* **Checkpoints** hold the average (``emapg_ema.safetensors``) and resume restores it.

**On-policy distillation**: ``teacher=`` (a model folder, an emapg built-in name or a loaded model that
uses the policy's tokenizer, checked when given as ``teacher_tokenizer=``) takes the reference's place:
the KL term is the per-token KL of the policy to the fixed teacher on the policy's own samples, by the
same estimators (``topk_reverse``: exact over the teacher's top-k plus a sampled tail correction,
unbiased in value and gradient), and ``pg_coef`` weights TRL's own loss (``loss = pg_coef * GRPO +
beta * KL``; 0 is pure distillation). No EMA is kept then (``eta`` is refused) and GRPOTrainer builds no
reference copy of the policy. A teacher with padded output rows is cut to the policy's rows; checkpoints
record the sha256 of its weights and a resume with other weights is refused.

``use_bias_correction_kl`` is TRL's switch between k3 and k3 times the ratio (emapg's ``k3pp`` on
policy); here ``kl`` chooses the estimator and that switch is ignored.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer
from trl.trainer.utils import add_fused_lm_head, disable_dropout_in_model

from emapg import kl as klmod
from emapg.anchor import EMAAnchor
from emapg.atomic import write_json_atomic
from emapg.config import TRL_KEYWORDS, ConfigError, check_fields
from emapg.models.lm import head_transform, token_logprobs, transform_logits
from emapg.models.zoo import fit_teacher, load_teacher, save_hf_folder, weights_digest
from emapg.tasks.base import Example

EMA_FILE, TEACHER_FILE = "emapg_ema.safetensors", "emapg_teacher.json"
TESTED_TRL = ">=1.16,<1.17"


def _unwrap_peft(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def task_reward(task, eos_token_id: int | list[int] | None = None) -> Callable[..., list[float]]:
    """A TRL reward function that scores with an emapg task's own training reward. Each completion's
    :class:`~emapg.tasks.base.Example` is rebuilt from the dataset's ``answer`` column; the other
    per-sample columns TRL passes become its ``meta``. Build the dataset as
    ``[{"prompt": ex.messages, "answer": ex.answer} for ex in task.train_examples(rng, n)]``.

    A task that zeroes a truncated response (``Task.zero_truncated``: the math task under ``grader: reference``, as
    the paper's recipes and rLLM do) needs ``eos_token_id`` (the tokenizer's; a list for several): a completion
    whose ids (TRL's ``completion_ids``) do not end with one ran out of tokens and scores 0."""
    if getattr(task, "zero_truncated", False) and eos_token_id is None:
        raise ConfigError(f"task_reward: {type(task).__name__} scores a truncated response 0 (as the recipes do): "
                          "pass eos_token_id=tokenizer.eos_token_id so that a truncated completion can be told")
    eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())

    def reward(completions, answer, completion_ids=None, **columns) -> list[float]:
        out = []
        for i, (comp, ans) in enumerate(zip(completions, answer, strict=True)):
            if eos and getattr(task, "zero_truncated", False) and completion_ids is not None and (
                    not completion_ids[i] or completion_ids[i][-1] not in eos):
                out.append(0.0)  # it ran out of tokens: 0, whatever its text
                continue
            text = comp[-1]["content"] if isinstance(comp, list) else comp
            meta = {k: v[i] for k, v in columns.items() if isinstance(v, list) and len(v) == len(completions)}
            out.append(float(task.reward(text, Example(id=str(i), messages=[], answer=ans, meta=meta))))
        return out

    reward.__name__ = f"{type(task).__name__}_reward"  # TRL logs each reward function by its name
    return reward


def prepare_teacher(trainer: GRPOTrainer, teacher: str | nn.Module, dtype: str | None,
                    teacher_tokenizer=None) -> tuple[nn.Module, str]:
    """The distillation teacher as TRL's reference model (frozen, fitted to the policy's vocabulary, with
    TRL's fused head at the sampling temperature, placed by accelerate) and the sha256 of its weights. A
    loaded teacher's tokenizer is checked against the policy's when ``teacher_tokenizer`` is given; without
    it a warning says that the caller vouches for it."""
    policy = _unwrap_peft(trainer.accelerator.unwrap_model(trainer.model))
    field = "EMAPGTrainer: teacher"
    try:  # the config's own rule
        check_fields({TRL_KEYWORDS["teacher_dtype"]: dtype}, names={TRL_KEYWORDS["teacher_dtype"]: "teacher_dtype"})
    except ConfigError as e:
        raise ConfigError(f"EMAPGTrainer: {e}") from None
    if isinstance(teacher, str):
        if teacher_tokenizer is not None:
            raise ConfigError("EMAPGTrainer: teacher_tokenizer is for a loaded teacher; a teacher folder or "
                              "built-in name brings its own tokenizer")
        name = teacher
        teacher, teacher_tok = load_teacher(name, dtype or str(policy.dtype).removeprefix("torch."), trainer.args.seed,
                                            field)
    elif isinstance(teacher, nn.Module) and hasattr(teacher, "get_output_embeddings"):
        name, teacher_tok = type(teacher).__name__, getattr(teacher_tokenizer, "tokenizer", teacher_tokenizer)
        if teacher_tok is None:
            warnings.warn("EMAPGTrainer: the teacher is a loaded model and no teacher_tokenizer was given, so "
                          "nothing checks that it maps token ids as the policy's tokenizer does (pass "
                          "teacher_tokenizer=, or the teacher's folder as teacher=)", stacklevel=3)
        if dtype is not None:
            teacher.to(getattr(torch, dtype))
    else:
        raise ConfigError(f"{field}: expected a model folder, a built-in name or a causal LM, got "
                          f"{type(teacher).__name__}")
    tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
    fit_teacher(teacher, teacher_tok, policy, tokenizer, name, policy.config.name_or_path, field)
    if trainer.args.disable_dropout:
        disable_dropout_in_model(teacher)
    digest = weights_digest(teacher)
    add_fused_lm_head(teacher, temperature=trainer.temperature, cast_lm_head_to_fp32=trainer.args.cast_lm_head_to_fp32)
    return trainer.accelerator.prepare_model(teacher, evaluation_mode=True), digest


WEIGHT_EMA_FILE = "emapg_weight_ema.safetensors"


class WeightEMACallback(TrainerCallback):
    """An EMA of the policy's weights kept for shipping, for a plain ``trl.GRPOTrainer`` (or any transformers
    ``Trainer``), outside the loss: ``trainer.add_callback(WeightEMACallback(0.9))``.

    After each optimizer step theta_w <- decay * theta_w + (1 - decay) * theta, in fp32 (emapg's
    :class:`~emapg.anchor.EMAAnchor`: a copy of the model; with a PEFT model an average of the adapters only).
    Each checkpoint holds it (``emapg_weight_ema.safetensors``, written by the main process) and a resume restores
    it from the checkpoint it resumes (``output_dir/checkpoint-STEP``): refused, naming the file, when that
    checkpoint has none. At the end of training it is written as a Hugging Face folder, ``output_dir/ema`` (LoRA
    merged), beside the policy the trainer saves: evaluate both and ship the better on your validation set
    (``emapg eval --model OUT OUT/ema ...``). ``average`` holds it, ``use(model)`` runs it. With
    :class:`EMAPGTrainer` at eta < 1 the reference already is this average: the callback is for GRPO as it is.
    """

    def __init__(self, decay: float = 0.9, every: int = 1, export: bool = True):
        try:  # the config's own rule for weight_ema
            check_fields({TRL_KEYWORDS["weight_ema"]: decay}, names={TRL_KEYWORDS["weight_ema"]: "decay"})
        except ConfigError as e:
            raise ConfigError(f"WeightEMACallback: {e}") from None
        if decay is None or not isinstance(every, int) or every < 1:
            raise ConfigError(f"WeightEMACallback: decay {decay!r} and every {every!r}: expected a decay in (0, 1) "
                              "and a whole number of optimizer steps >= 1")
        self.decay, self.every, self.export = decay, every, export
        self.ema: EMAAnchor | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        model = _unwrap_peft_outer(model)
        self.ema = EMAAnchor(model, eta=self.decay, every=self.every)
        if state.global_step > 0:  # a resume: transformers loaded this checkpoint's trainer state
            path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}", WEIGHT_EMA_FILE)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"WeightEMACallback: {path}: the checkpoint this run resumes at step "
                                        f"{state.global_step} holds no weight EMA (was the callback added when it "
                                        "was written?)")
            self.ema.load_state_dict(load_file(path))

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.ema.step(_unwrap_peft_outer(model))

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.ema is not None:
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            tmp = os.path.join(folder, f".{WEIGHT_EMA_FILE}.tmp-{os.getpid()}")
            save_file({k: v.detach().contiguous().cpu() for k, v in self.ema.state_dict().items()}, tmp)
            os.replace(tmp, os.path.join(folder, WEIGHT_EMA_FILE))

    def on_train_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        if self.export and state.is_world_process_zero and self.ema is not None:

            tokenizer = processing_class if processing_class is not None else kwargs.get("tokenizer")
            with self.ema.use(_unwrap_peft_outer(model)) as m:
                save_hf_folder(m, tokenizer, Path(args.output_dir) / "ema")

    def use(self, model: nn.Module):
        """The weight EMA as a module (a context manager: with LoRA the averaged adapters are swapped into
        ``model`` and put back on exit)."""
        return self.ema.use(_unwrap_peft_outer(model))


def _unwrap_peft_outer(model: nn.Module) -> nn.Module:
    """The model the trainer steps, unwrapped from DDP (``module``) but not from PEFT (the adapters average)."""
    return getattr(model, "module", model)


class _EMAStep(TrainerCallback):
    """Moves the reference after each optimizer step (``on_step_end`` follows the step)."""

    def __init__(self, trainer: EMAPGTrainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer.ema_step()


def _checked(kl: str, k: int, form: str, head: str, eta: float, ema_every: int, pg_coef: float):
    """The KL's arguments by the config's own table (the same ranges and names as `emapg train` accepts);
    returns the estimator's declaration."""
    given = {"kl": kl, "form": form, "k": k, "eta": eta, "ema_every": ema_every, "pg_coef": pg_coef, "head": head}
    try:  # each keyword by its field's rule, named as the keyword
        check_fields({TRL_KEYWORDS[key]: value for key, value in given.items()},
                     names={TRL_KEYWORDS[key]: key for key in given})
    except ConfigError as e:
        raise ConfigError(f"EMAPGTrainer: {e}") from None
    est = klmod.estimator_named(kl)
    if (error := est.form_error(form)) is not None:
        raise ConfigError(f"EMAPGTrainer: form={error}")
    return est


def _refuse_unsupported(kl: str, est, args) -> None:
    """What EMAPGTrainer cannot do, refused before TRL builds anything."""
    if est.head == "all":
        raise ValueError(f"EMAPGTrainer: kl={kl!r} needs the reference's log-probs at every vocabulary id of "
                         "every token between generation and loss; use topk_reverse or topk_forward with a "
                         "large k instead")
    if args is None or args.beta == 0.0:
        raise ValueError("EMAPGTrainer: GRPOConfig.beta is 0, so there is no KL term for the EMA reference "
                         "to anchor; set beta (e.g. GRPOConfig(beta=0.001))")
    if args.sync_ref_model:
        raise ValueError("EMAPGTrainer: GRPOConfig.sync_ref_model mixes the reference every "
                         "ref_model_sync_steps; the EMA reference replaces it (set eta, ema_every instead)")


class EMAPGTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` with an EMA reference and an emapg KL estimator; constructed like it.

    Args (besides GRPOTrainer's):
        eta: EMA decay in (0, 1], default 0.9; 1 keeps the initial reference (GRPO).
        ema_every: update the reference every this many optimizer steps.
        kl: an emapg estimator name (:data:`emapg.kl.ESTIMATORS`), default the unbiased top-k reverse KL.
        k: head size of the top-k estimators.
        form: the top-k estimator's tail (:data:`emapg.kl.TAILS`: ``"unbiased"``, the default, ``"paper"``,
            ``"bucket"``, ``"residual"``, ``"renormalised"``, ``"truncated"``).
        head: the top-k estimator's head: ``"anchor"`` (default: the reference's or the teacher's own top-k,
            found in the reference pass at no extra cost), ``"sampler"`` (the policy's own top-k at generation,
            from one more no-grad forward of the policy per generation batch) or ``"union"`` (both).
        teacher: on-policy distillation: the fixed reference of the KL term instead of the EMA (a model
            folder, an emapg built-in name, or a loaded causal LM with the policy's tokenizer).
        teacher_dtype: the teacher's dtype (default the policy's); ``pg_coef``: weight of TRL's own loss.
        teacher_tokenizer: a loaded teacher's tokenizer, checked against the policy's (id by id).
    """

    def __init__(self, model, reward_funcs, args=None, *pos, eta: float | None = None, ema_every: int = 1,
                 kl: str = "topk_reverse", k: int = 32, form: str = "unbiased", head: str = "anchor",
                 teacher: str | nn.Module | None = None, teacher_dtype: str | None = None, pg_coef: float = 1.0,
                 teacher_tokenizer=None, **kwargs):
        if teacher is not None and eta is not None:
            raise ValueError("EMAPGTrainer: with a teacher the KL's reference is the teacher, and no EMA is kept; "
                             "drop eta")
        eta = 0.9 if eta is None else eta
        est = _checked(kl, k, form, head, eta, ema_every, pg_coef)
        _refuse_unsupported(kl, est, args)
        self.kl_name, self.kl_k, self.kl_form = kl, (k if est.head != "none" else 0), form
        self.kl_head = head if est.topk else None
        self.pg_coef, self.teacher_name = float(pg_coef), (teacher if isinstance(teacher, str) else None)
        self._capture: list[tuple[Tensor, Tensor]] | None = None
        self._ref_head: dict[str, Tensor] | None = None
        beta = args.beta
        if teacher is not None:  # GRPOTrainer then builds no reference (a copy of the policy, or a ref adapter)
            args.beta = 0.0
        try:
            super().__init__(model, reward_funcs, args, *pos, **kwargs)
        finally:
            args.beta = beta
        self.beta = beta
        zero3 = self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3
        if self.is_fsdp_enabled or zero3:
            raise ValueError("EMAPGTrainer: parameters sharded by FSDP or DeepSpeed ZeRO-3 are not supported yet "
                             "(the EMA and the head gathers read whole tensors); use DDP or ZeRO-1/2, or "
                             "emapg's own trainer (emapg train --nproc N, FSDP2)")
        policy = self.accelerator.unwrap_model(self.model)
        if self.kl_k > (vocab := policy.get_output_embeddings().weight.shape[0]):  # as emapg train refuses it
            raise ConfigError(f"EMAPGTrainer: k={k} is more than the model's vocabulary of {vocab} tokens")
        self.peft = hasattr(policy, "peft_config")
        if self.peft and self.kl_head not in (None, "anchor") and any(
                "lora" in n for n, _ in policy.get_output_embeddings().named_parameters()):
            raise ValueError(f"EMAPGTrainer: head={head!r} reads the reference's output layer at the policy's ids, "
                             "and LoRA adapts the output layer here; use head='anchor', or leave lm_head out of "
                             "target_modules")
        self.teacher_sha256 = None
        if teacher is not None:
            self.ref_model, self.teacher_sha256 = prepare_teacher(self, teacher, teacher_dtype, teacher_tokenizer)
            self.anchor = None
            return
        if self.peft:
            if "ref" not in policy.peft_config:
                policy.add_adapter("ref", policy.peft_config["default"])
            self.anchor = EMAAnchor(policy, eta=eta, every=ema_every, mode="lora")
            self._ref_params = {n: p for n, p in policy.named_parameters() if ".ref." in n}
            for p in self._ref_params.values():
                p.requires_grad_(False)
            self._write_ref_adapter()
        else:
            ref = self.accelerator.unwrap_model(self.ref_model)
            ref.load_state_dict(policy.state_dict())  # the average starts at this policy, whatever TRL loaded
            self.anchor = EMAAnchor(policy, eta=eta, every=ema_every, mode="full", module=ref)
        self.add_callback(_EMAStep(self))

    # ---- the EMA reference ---------------------------------------------------------------------

    def _write_ref_adapter(self) -> None:
        with torch.no_grad():
            for name, avg in self.anchor.average.items():
                self._ref_params[name.replace(".default.", ".ref.")].copy_(avg)

    def ema_step(self) -> bool:
        """Count one optimizer step; move the reference when due. Returns whether it moved."""
        if self.anchor is None:  # distillation: the teacher does not move
            return False
        moved = self.anchor.step(self.accelerator.unwrap_model(self.model))
        if moved and self.peft:
            self._write_ref_adapter()
        return moved

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)

        folder = os.path.join(self._get_output_dir(trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save and self.anchor is None:
            write_json_atomic(os.path.join(folder, TEACHER_FILE),
                              {"teacher": self.teacher_name, "teacher_sha256": self.teacher_sha256, "kl": self.kl_name,
                               "k": self.kl_k, "form": self.kl_form, "head": self.kl_head, "pg_coef": self.pg_coef})
        elif self.args.should_save:
            state = {k: v.detach().contiguous().cpu() for k, v in self.anchor.state_dict().items()}
            tmp = os.path.join(folder, f".{EMA_FILE}.tmp-{os.getpid()}")
            save_file(state, tmp)
            os.replace(tmp, os.path.join(folder, EMA_FILE))
            write_json_atomic(os.path.join(folder, "emapg_ema.json"),
                              {"eta": self.anchor.eta, "every": self.anchor.every, "kl": self.kl_name,
                               "k": self.kl_k, "form": self.kl_form, "head": self.kl_head,
                               "mode": self.anchor.mode})

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        if self.anchor is None:
            self._check_teacher(checkpoint)
            return
        path = os.path.join(checkpoint, EMA_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: this checkpoint holds no EMA reference (was it written by "
                                    "EMAPGTrainer?)")
        self.anchor.load_state_dict(load_file(path))
        if self.peft:
            self._write_ref_adapter()
        else:
            self.anchor._sync_module()

    def _check_teacher(self, checkpoint: str) -> None:
        """Refuse to resume distillation from ``checkpoint`` against a teacher with other weights."""
        path = os.path.join(checkpoint, TEACHER_FILE)
        try:
            with open(path, encoding="utf-8") as f:
                saved = json.load(f)["teacher_sha256"]
        except (OSError, ValueError, KeyError):
            raise FileNotFoundError(f"{path}: this checkpoint records no distillation teacher (was it written by "
                                    "EMAPGTrainer with teacher=?)") from None
        if saved != self.teacher_sha256:
            raise ConfigError(f"EMAPGTrainer: {checkpoint} was trained against a teacher with weights sha256 "
                              f"{saved[:12]}..., this teacher's are {self.teacher_sha256[:12]}...; resume with "
                              "the same teacher, or start a new run")

    # ---- the reference's head, and the policy's log-probs at it ---------------------------------

    @contextlib.contextmanager
    def _hidden(self, model: nn.Module) -> Iterator[list[Tensor]]:
        """Collect the final hidden states of ``model``'s backbone during the block."""
        backbone = _unwrap_peft(self.accelerator.unwrap_model(model)).base_model
        seen: list[Tensor] = []

        def hook(_module, _inputs, output):
            seen.append(output[0] if isinstance(output, tuple) else output.last_hidden_state)

        handle = backbone.register_forward_hook(hook)
        try:
            yield seen
        finally:
            handle.remove()

    def _is_ref_call(self, model: nn.Module) -> bool:
        if self.peft and self.anchor is not None:
            return getattr(self.accelerator.unwrap_model(model), "active_adapter", None) == "ref"
        return model is self.ref_model

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                           *args, **kwargs):
        ref_call = self._is_ref_call(model)
        if not ref_call and self._capture is None:
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                              *args, **kwargs)
        with self._hidden(model) as seen:
            out = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                             *args, **kwargs)
        hidden = torch.cat(seen, 0)[:, -logits_to_keep - 1 : -1]  # position t predicts token t + 1
        if ref_call:
            if self.kl_k > 0 and self.kl_head == "anchor":
                self._ref_head = self._ref_topk(model, hidden, input_ids[:, -logits_to_keep:])
            elif self.kl_k > 0:  # the reference's head pass waits for the policy's ids (_policy_head)
                self._ref_head = {"hidden": hidden, "model": model}
        else:
            self._capture.append((out[0], hidden))
        return out

    def _head(self, model: nn.Module) -> tuple[Tensor, Tensor | None]:
        head = _unwrap_peft(self.accelerator.unwrap_model(model)).get_output_embeddings()
        return head.weight, head.bias

    @torch.no_grad()
    def _ref_topk(self, model: nn.Module, hidden: Tensor, tokens: Tensor) -> dict[str, Tensor]:
        """The reference's own top-k ids and log-probs at every completion position: [B, C, k]."""
        w, b = self._head(model)
        b_, c, h = hidden.shape
        tf = head_transform(_unwrap_peft(self.accelerator.unwrap_model(model)))
        with self.accelerator.autocast():  # the precision of the forward that made ``hidden`` (bf16 under bf16=True)
            st = token_logprobs(hidden.reshape(-1, h), w, tokens.reshape(-1), bias=b, temperature=self.temperature,
                                k_self=self.kl_k, transform=tf)
        return {"ref_head_ids": st.topk_ids.view(b_, c, -1), "ref_head_logps": st.topk_logp.view(b_, c, -1)}

    def _policy_logps_at(self, model: nn.Module, hidden: Tensor, logp_tok: Tensor, tokens: Tensor,
                         ids: Tensor) -> Tensor:
        """log pi at ``ids`` [B, C, k] from the policy's hidden states and its log-prob of the sampled
        token: log pi(j) = z_j - z_y + log pi(y) (one log-sum-exp), differentiable in all three."""
        w, b = self._head(model)
        tf = head_transform(_unwrap_peft(self.accelerator.unwrap_model(model)))
        both = torch.cat([tokens.unsqueeze(-1), ids], -1)  # [B, C, 1 + k]
        rows = torch.nn.functional.embedding(both, w)  # [B, C, 1 + k, H]
        with self.accelerator.autocast():  # the precision of the forward that made ``hidden``
            z = torch.matmul(rows, hidden.unsqueeze(-1).to(rows.dtype)).squeeze(-1)
        if b is not None:
            z = z + b[both]
        z = transform_logits(z, self.temperature, tf)
        return z[..., 1:] - z[..., :1] + logp_tok.unsqueeze(-1)

    # ---- generation adds the head; the loss adds emapg's KL --------------------------------------

    @torch.no_grad()
    def _policy_head(self, output: dict[str, Any]) -> None:
        """``head="sampler"`` or ``"union"``: the policy's own top-k ids at each completion position (one no-grad
        forward), and the reference's log-probs at them from the hidden states its pass left; the output's
        head becomes those ids (sampler) or both sets (union, a repeated id counted once)."""
        ref = self._ref_head
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], 1)
        att = torch.cat([output["prompt_mask"], output["completion_mask"]], 1)
        c = output["completion_ids"].shape[1]
        tokens = output["completion_ids"]
        with self._hidden(self.model) as seen:
            super()._get_per_token_logps_and_entropies(self.model, ids, att, c)
        hidden = torch.cat(seen, 0)[:, -c - 1 : -1]
        mine = self._ref_topk(self.model, hidden, tokens)["ref_head_ids"]  # the policy's own top-k
        w, b = self._head(ref["model"])
        h = ref["hidden"]
        tf = head_transform(_unwrap_peft(self.accelerator.unwrap_model(ref["model"])))
        union = self.kl_head == "union"
        with self.accelerator.autocast():  # one head pass: the reference at the policy's ids, and its own top-k
            st = token_logprobs(h.reshape(-1, h.shape[-1]), w, tokens.reshape(-1), bias=b,
                                ids=mine.reshape(-1, mine.shape[-1]), temperature=self.temperature,
                                k_self=self.kl_k if union else 0, transform=tf)
        at_mine = st.logp_ids.view(mine.shape)
        if not union:
            output.update(ref_head_ids=mine, ref_head_logps=at_mine)
            return
        both, mask = klmod.union_mask(mine, st.topk_ids.view(mine.shape))
        output.update(ref_head_ids=both, ref_head_logps=torch.cat([at_mine, st.topk_logp.view(mine.shape)], -1),
                      ref_head_mask=mask)

    def _generate_and_score_completions(self, inputs):
        self._ref_head = None
        output = super()._generate_and_score_completions(inputs)
        if self._ref_head is not None:
            if self.kl_head == "anchor":
                output.update(self._ref_head)
            else:
                self._policy_head(output)
            self._ref_head = None
        return output

    def _compute_loss(self, model, inputs):
        beta, self.beta = self.beta, 0.0  # TRL's loss without its k3 term ...
        self._capture = []
        try:
            loss = super()._compute_loss(model, inputs)
            (logp, hidden), = self._capture
        finally:
            self.beta, self._capture = beta, None
        kl_tok = self._token_kl(model, inputs, logp, hidden)
        mask = inputs["completion_mask"]
        mask = mask if "tool_mask" not in inputs else mask * inputs["tool_mask"]
        mode = "train" if self.model.training else "eval"
        m = mask.to(kl_tok.dtype)
        totals = self.accelerator.reduce(torch.stack([(kl_tok.detach() * m).sum(), m.sum()]), reduction="sum")
        self._metrics[mode]["kl"].append((totals[0] / totals[1].clamp(min=1.0)).item())
        return self.pg_coef * loss + beta * self._aggregate(kl_tok, mask, inputs, mode)  # ... plus emapg's, alike

    def _token_kl(self, model, inputs, logp: Tensor, hidden: Tensor) -> Tensor:
        """emapg's per-token KL estimate [B, C] of the policy against the reference (the EMA, or the teacher)."""
        tokens = inputs["completion_ids"]
        old = inputs.get("old_per_token_logps")  # pi_old, when it differs from the policy being trained
        samp = inputs.get("sampling_per_token_logps") if self.use_vllm else None  # vLLM's pi_samp
        if samp is not None:  # a token vLLM could not score is NaN: weigh it by pi_old instead
            samp = torch.where(torch.isnan(samp), logp.detach() if old is None else old, samp)
        samp = old if samp is None else samp
        pol_q = anc_q = in_q = None
        if self.kl_k > 0 and "ref_head_ids" not in inputs:
            raise RuntimeError("EMAPGTrainer: the batch has no reference top-k (the reference pass was not seen); "
                               "this TRL version may compute the reference differently than 1.16")
        if "ref_head_ids" in inputs:
            ids = inputs["ref_head_ids"]
            pol_q = self._policy_logps_at(model, hidden, logp, tokens, ids)
            anc_q = inputs["ref_head_logps"]
            in_q = klmod.in_head(ids, tokens)
        return klmod.kl_from_logprobs(self.kl_name, logp, inputs["ref_per_token_logps"], samp_logp_tok=samp,
                                      policy_logp_q=pol_q, anchor_logp_q=anc_q, in_q=in_q,
                                      head_mask=inputs.get("ref_head_mask"), form=self.kl_form)

    def _aggregate(self, values: Tensor, mask: Tensor, inputs: dict[str, Any], mode: str) -> Tensor:
        """TRL 1.16's reduction of a per-token loss for ``self.loss_type`` (GRPOTrainer._compute_loss)."""
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        t = self.loss_type
        if t in ("grpo", "sapo"):
            return ((values * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation
        if t == "bnpo":
            return (values * mask).sum() / mask.sum().clamp(min=1.0) / accumulation
        if t == "dr_grpo":
            return (values * mask).sum() / (values.size(0) * self.max_completion_length) / accumulation
        if t in ("cispo", "dapo", "vespo"):
            normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
            return (values * mask).sum() / normalizer
        if t == "luspo":
            return (values * mask).sum(-1).mean() / accumulation
        raise ValueError(f"EMAPGTrainer: loss_type {t!r} is not one TRL {TESTED_TRL} has")


__all__ = ["EMAPGTrainer"]
