"""Rollout backends, by name (``rollout.backend``; ``emapg eval --backend``): who samples a run's responses.

``hf`` is emapg's own decode loop over the training model (no engine). Any other backend is an *engine*
that holds a copy of the policy's weights and samples with them; it is declared once here, and from a
user's own module with :func:`register_backend` (listed in a config's ``plugins``). An engine has

- ``eos``: the token ids that end a response;
- ``sync(model, version) -> bool``: take the policy's weights when ``version`` (the steps done) changed;
- ``generate(examples, spec, *, seed, device) -> RolloutBatch``: ``spec.n`` responses per example, each
  token's log-prob under the sampling distribution and, when ``spec.k``, its top-k ids (the contract of
  :mod:`emapg.rollout.sampling`);
- ``sampler(spec, *, stop, seed)``: a function ``(contexts, max_new_tokens) -> Sampled`` that continues
  token contexts (tool episodes, :mod:`emapg.rollout.agent`);
- ``after_rollout()`` and ``close()``.

Its builders are given as ``"module:function"`` (imported only when a run asks for the backend, so its
packages are optional) or as the functions themselves:
``for_run(cfg, model, tokenizer, task, spec, *, device, rank, rows, workdir)`` for training and
``for_eval(model, tokenizer, tasks, spec, *, device, dtype, seed, rows)`` for ``emapg eval``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


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

    def builder(self, which: str) -> Callable[..., Any] | None:
        """``for_run`` or ``for_eval``, imported if given as ``"module:function"``."""
        ref = getattr(self, which)
        if not isinstance(ref, str):
            return ref
        module, _, attr = ref.partition(":")
        return getattr(importlib.import_module(module), attr)


BACKENDS: dict[str, Backend] = {
    "hf": Backend("hf", recomputes_old=False),
    # vLLM refuses T > 2 and silently raises T < 0.01 to 0.01 (the loss would then use another T)
    "vllm": Backend("vllm", "emapg.rollout.vllm_backend:engine_for_run", "emapg.rollout.vllm_backend:engine_for_eval",
                    recomputes_old=True, temperatures=(0.01, 2.0)),
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
