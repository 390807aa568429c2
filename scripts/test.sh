#!/usr/bin/env bash
# Set up (idempotent) and run the fast test suite with lint. Real-model tests: add `-m slow`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
.venv/bin/ruff check src tests bench examples
.venv/bin/python -m pytest -q "$@"
