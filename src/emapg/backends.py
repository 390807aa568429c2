"""Rollout backends, by name (``rollout.backend``; ``emapg eval --backend``): who samples a run's responses.

``hf`` is emapg's own decode loop over the training model (:class:`emapg.rollout.DecodeLoop`, built by the run;
no builder). Any other backend is an *engine* that holds a copy of the policy's weights and samples with them;
it is declared once here, and from a user's own module with :func:`register_backend` (listed in a config's
``plugins``). An engine has

- ``sync(model, version) -> bool``: take the policy's weights when ``version`` (the steps done) changed;
- ``rollout(task, examples, spec, *, seed, device) -> RolloutBatch``: ``spec.n`` responses per example, each
  token's log-prob under the sampling distribution and, when ``spec.k``, its top-k ids (the contract of
  :mod:`emapg.rollout.sampling`); :func:`emapg.rollout.sampled_rollout` builds it from the engine's
- ``generate(examples, spec, *, seed, device) -> RolloutBatch`` (one turn), ``sampler(spec, *, stop, seed)`` (a
  function ``(contexts, max_new_tokens) -> Sampled`` that continues token contexts: tool episodes,
  :mod:`emapg.rollout.agent`) and ``eos`` (the token ids that end a response);
- ``after_rollout()`` and ``close()``.

Its builders are given as ``"module:function"`` (imported only when a run asks for the backend, so its
packages are optional) or as the functions themselves:
``for_run(cfg, model, tokenizer, task, spec, *, device, rank, rows, workdir)`` for training and
``for_eval(model, tokenizer, tasks, spec, *, device, dtype, seed, rows)`` for ``emapg eval``.

A backend declares the rest of what it is, so the core knows no backend by name: ``settings``, a dataclass of
its settings (a config's ``rollout.backend_args``, each key checked against it, its ``problems()`` if it has
one; ``for_run`` reads them with :func:`backend_settings`); ``memory(settings, params, gpu_memory, device)``,
its engine's share of a device for ``emapg plan`` (an :class:`EngineMemory`); its
files in a run folder are ``RUN/<name>/`` (``for_run``'s ``workdir``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from emapg.errors import ConfigError
from emapg.settings import typed


@dataclass(frozen=True)
class EngineMemory:
    """What a backend's engine holds of a device (a backend's ``memory`` returns it): ``share`` bytes; whether it
    sleeps through the update (then only the rollout holds it); what the plan could not count; the setting that
    shrinks it."""

    share: float
    sleeps: bool
    notes: tuple[str, ...] = ()
    fix: str | None = None


@dataclass(frozen=True)
class Backend:
    """One rollout backend. ``for_run`` / ``for_eval``: its engine's builders (None: emapg's decode loop over
    the model itself). ``recomputes_old``: its sampled log-probs are not the trainer's pi_old (another
    engine's numerics), so ``algo.recompute_old`` defaults to true with it. ``temperatures``: the range it
    samples at exactly (a config outside it is refused), None: any."""

    name: str
    for_run: str | Callable[..., Any] | None = None
    for_eval: str | Callable[..., Any] | None = None
    recomputes_old: bool = True
    temperatures: tuple[float, float] | None = None
    settings: str | type | None = None
    memory: str | Callable[..., Any] | None = None

    def builder(self, which: str) -> Any:
        """``for_run``, ``for_eval``, ``settings`` or ``memory``, imported if given as ``"module:name"``."""
        ref = getattr(self, which)
        if not isinstance(ref, str):
            return ref
        module, _, attr = ref.partition(":")
        return getattr(importlib.import_module(module), attr)

    def settings_of(self, args: dict[str, Any]) -> Any:
        """``args`` (a config's ``rollout.backend_args``) as this backend's settings; ConfigError naming every
        unknown key, wrong type or value out of range (the config's reader, :func:`emapg.settings.typed`: its
        fields are declared with ``setting(default, rule=...)`` as the config's are). A backend without settings
        takes none."""
        cls = self.builder("settings")
        where = f"rollout.backend_args (backend {self.name})"
        if cls is None:
            if args:
                raise ConfigError(f"{where}: this backend takes no settings, got {', '.join(sorted(args))}")
            return None
        settings = typed(cls, args, "rollout.backend_args")  # its types and each field's rule, every problem at once
        problems = settings.problems() if hasattr(settings, "problems") else []  # a plugin's own checks across fields
        if problems:
            raise ConfigError("; ".join(problems), problems)
        return settings


BACKENDS: dict[str, Backend] = {
    "hf": Backend("hf", recomputes_old=False),
    # vLLM refuses T > 2 and silently raises T < 0.01 to 0.01 (the loss would then use another T)
    "vllm": Backend("vllm", "emapg.rollout.vllm_backend:engine_for_run", "emapg.rollout.vllm_backend:engine_for_eval",
                    recomputes_old=True, temperatures=(0.01, 2.0), settings="emapg.rollout.vllm_settings:VLLMSettings",
                    memory="emapg.rollout.vllm_settings:engine_memory"),
}
"""Every rollout backend, by name; the config's ``rollout.backend`` and ``emapg eval --backend`` take these."""


def register_backend(backend: Backend) -> Backend:
    """Add a backend (from a user's module); a name already taken is refused."""
    if backend.name in BACKENDS:
        raise ValueError(f"rollout backend {backend.name!r} is already registered")
    if backend.for_run is None and backend.for_eval is None:
        raise ValueError(f"rollout backend {backend.name!r}: give for_run or for_eval (hf is the decode loop)")
    BACKENDS[backend.name] = backend
    return backend


def backend_settings(rollout: Any) -> Any:
    """The settings of a rollout config's backend (``rollout.backend_args`` checked: :meth:`Backend.settings_of`)."""
    return BACKENDS[rollout.backend].settings_of(rollout.backend_args)
