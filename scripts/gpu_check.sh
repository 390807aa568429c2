#!/usr/bin/env bash
# GPU check, under 8 minutes on one GPU. What it checks, in order:
#   1. the GPU is visible to torch (device name, memory);
#   2. the estimator, log-prob, objective and anchor unit tests with every tensor on CUDA
#      (EMAPG_TEST_DEVICE=cuda): exact-enumeration checks of the top-k estimators in float64 on the GPU;
#   3. 3 training steps of a Qwen2.5-0.5B-shaped model (random weights: nothing is downloaded) with the
#      HF rollout backend on CUDA, fp32 master weights + bf16 autocast, EMA anchor + top-k KL;
#      then the same with gradient checkpointing (prefix sharing off);
#      then one step of a Qwen2.5-1.5B-shaped model at 4,096 new tokens (no EOS: every row runs the whole
#      budget), gradient checkpointing on, printing peak GPU memory;
#   4. with 2 or more GPUs: the same 3 steps on 2 GPUs with torchrun + FSDP2 (NCCL);
#   5. when vllm is installed (pip install 'emapg[vllm]'): the real-engine tests that CI runs on vLLM's
#      CPU build (tests/test_vllm_engine.py: log-probs and top-k against the reference, greedy, weight
#      pushes, LoRA, agent episodes, shutdown), on CUDA, then the 3 steps of 3a with rollout.backend=vllm;
#   6. `emapg eval --device cuda` on two of the published-format fixtures (and --backend vllm when installed);
# and prints, per run, the median step time, generated tokens per second and peak GPU memory.
# Usage: bash scripts/gpu_check.sh   (after scripts/setup.sh, or with EMAPG_TORCH_SPEC=skip on a CUDA torch)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/emapg-gpu-check}
rm -rf "$OUT" && mkdir -p "$OUT"

echo "== 1. device"
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; p = torch.cuda.get_device_properties(0); print(torch.__version__, p.name, f'{p.total_memory / 2**30:.0f} GiB', torch.cuda.device_count(), 'GPU(s)')"

echo "== 2. unit tests on CUDA"
EMAPG_TEST_DEVICE=cuda timeout 240 $PY -m pytest -q -x -p no:cacheprovider tests/test_kl.py tests/test_logprobs.py \
  tests/test_objective.py tests/test_anchor.py 2>&1 | tail -5

COMMON=(--config recipes/smoke.yaml model=random-qwen2.5-0.5b device=cuda mixed_precision=bf16 steps=3
        prompts_per_step=8 micro_batch_prompts=4 rollout.n=4 rollout.max_new_tokens=256 eval.size=0 export=false
        save_every=100 algo.kl=topk_reverse algo.k=32 algo.eta=0.9 lr=1e-6)

report() {  # median step seconds and generated tokens per second of a run folder
  $PY - "$1" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl") if l.strip()]
rows = [r for r in rows if "step_seconds" in r]
tok = [r["response_length"] * r["responses"] / r["gen_seconds"] for r in rows]
print(f"   steps {len(rows)}: median step {statistics.median(r['step_seconds'] for r in rows):.2f} s "
      f"(generation {statistics.median(r['gen_seconds'] for r in rows):.2f} s), "
      f"{statistics.median(tok):.0f} generated tokens/s, mean response {statistics.fmean(r['response_length'] for r in rows):.0f} tokens, "
      f"peak GPU memory {max(r.get('peak_memory_gb', float('nan')) for r in rows):.1f} GB")
PY
}

echo "== 3a. 3 steps, Qwen2.5-0.5B shape, HF backend, bf16 autocast"
timeout 240 $PY -m emapg train "${COMMON[@]}" --out "$OUT/hf" 2>&1 | tail -2
report "$OUT/hf"
echo "== 3b. the same with gradient checkpointing"
timeout 240 $PY -m emapg train "${COMMON[@]}" gradient_checkpointing=true prefix_sharing=false --out "$OUT/gc" 2>&1 | tail -2
report "$OUT/gc"
echo "== 3c. 1 step, Qwen2.5-1.5B shape, 4,096 new tokens, gradient checkpointing"
timeout 420 $PY -m emapg train "${COMMON[@]}" model=random-qwen2.5-1.5b steps=1 prompts_per_step=4 \
  micro_batch_prompts=1 rollout.max_new_tokens=4096 gradient_checkpointing=true prefix_sharing=false \
  --out "$OUT/1p5b" 2>&1 | tail -2
report "$OUT/1p5b"

NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -ge 2 ]; then
  echo "== 4. 2 GPUs, torchrun + FSDP2"
  timeout 240 $PY -m torch.distributed.run --standalone --nproc_per_node 2 -m emapg train "${COMMON[@]}" \
    --out "$OUT/fsdp2" 2>&1 | tail -2
  report "$OUT/fsdp2"
else
  echo "== 4. skipped: one GPU (FSDP2 over 2 processes is checked on CPU with gloo in the test suite)"
fi
if $PY -c "import vllm" 2>/dev/null; then
  echo "== 5a. the real vLLM engine's tests on CUDA (tests/test_vllm_engine.py: run on the CPU build in CI)"
  timeout 400 $PY -m pytest -q -x -m vllm -p no:cacheprovider tests/test_vllm_engine.py 2>&1 | \
    grep -E "passed|failed|skipped|Error" | tail -6
  echo "== 5b. 3 steps, Qwen2.5-0.5B shape, vLLM backend"
  timeout 200 $PY -m emapg train "${COMMON[@]}" rollout.backend=vllm rollout.vllm_max_model_len=1024 --out "$OUT/vllm" 2>&1 | tail -2
  report "$OUT/vllm"
else
  echo "== 5. skipped: vllm is not installed (pip install 'emapg[vllm]')"
fi
echo "== 6. emapg eval on the GPU: two published-format sets, 2 samples each, a row per set and their average"
EVAL=(--model random-qwen2.5-0.5b --task math --task-args '{"template": "chat"}' --device cuda --samples 2
      --temperature 1.0 --top-p 0.95 --max-new-tokens 64
      --data tests/fixtures/evalsets/math500.jsonl tests/fixtures/evalsets/olympiadbench.jsonl)
timeout 90 $PY -m emapg eval "${EVAL[@]}" --out "$OUT/eval" 2>&1 | tail -8
if $PY -c "import vllm" 2>/dev/null; then
  echo "== 6b. the same with --backend vllm"
  timeout 150 $PY -m emapg eval "${EVAL[@]}" --backend vllm --out "$OUT/eval-vllm" 2>&1 | tail -8
fi
echo "== done: runs in $OUT"
