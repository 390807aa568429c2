#!/usr/bin/env bash
# Set up (idempotent) and run the fast test suite with lint, then the real vLLM engine's tests in
# .venv-vllm (scripts/setup.sh says why that is a venv of its own). Real-model tests: add `-m slow`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
.venv/bin/ruff check src tests bench examples
.venv/bin/python -m pytest -q "$@"
if [ -x .venv-vllm/bin/python ] && [ "${EMAPG_VLLM:-cpu}" = "cpu" ]; then
  .venv-vllm/bin/python -m pytest -q -m vllm tests/test_vllm_engine.py
fi
