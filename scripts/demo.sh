#!/usr/bin/env bash
# Set up (idempotent) and run the main job: EMA-PG on SmolLM2-135M, arithmetic, on this CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
EMAPG_VLLM=${EMAPG_VLLM:-skip} bash scripts/setup.sh  # the demo needs no vLLM venv (test.sh builds it)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/emapg train "$@"
