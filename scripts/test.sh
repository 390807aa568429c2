#!/usr/bin/env bash
# Set up (idempotent) and run the fast test suite with lint, then the real vLLM engine's tests in
# .venv-vllm (scripts/setup.sh says why that is a venv of its own), where the tests of emapg's own use of
# transformers' key/value cache also run (that venv pins an older transformers). Real-model tests: add `-m slow`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "${EMAPG_VLLM:-}" = "cpu" ] && [ ! -x .venv-vllm/bin/python ]; then  # asked for, and they cannot run
  echo "scripts/test.sh: EMAPG_VLLM=cpu asks for the real vLLM engine's tests, but .venv-vllm was not built" \
       "(scripts/setup.sh builds it on x86_64 only)" >&2
  exit 1
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
.venv/bin/ruff check src tests bench examples studies
# the 15 slowest tests end the log (what to speed up: the default suite aims at 10 minutes; README, 'What they cost', says what it takes)
.venv/bin/python -m pytest -q -rs --durations=15 "$@"   # -rs: every skipped test with its reason
if [ $# -eq 0 ]; then  # the docs' slow blocks too (the README's main job, --nproc 2, compare, TRL, vLLM), scaled
  .venv/bin/python -m pytest -q -m slow tests/test_docs.py -k test_every_documented_block_runs   # down
  .venv/bin/python -m pytest -q -s -m mainjob tests/test_main_job.py   # the README's main job as written
fi
if [ -x .venv-vllm/bin/python ] && [ "${EMAPG_VLLM:-cpu}" = "cpu" ]; then
  .venv-vllm/bin/python -m pytest -q -m vllm tests/test_vllm_engine.py
  .venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/test_decode.py tests/test_forward.py tests/test_pool.py
fi
