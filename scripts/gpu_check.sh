#!/usr/bin/env bash
# The GPU acceptance run: on one GPU its timeouts add to at most 480 s (tests/test_house.py sums them); every
# check runs even when an earlier one fails; one table at the end (check, result, figure). Figures come from
# scripts/gpu_checks.py. The checks:
#   device      the GPU torch sees
#   unit        the estimator, log-prob, objective and anchor tests with every tensor on CUDA (float64 enumeration)
#   signal      3 steps of SmolLM2-135M on one-digit additions, bf16 autocast: some groups get different rewards,
#               so the policy gradient runs (a random model scores 0 everywhere)
#   agree       one micro-batch's loss, bf16 autocast against fp32, the same rollout
#   resume      2 steps in one go against 1 step + a resume to 2: the same policy and anchor; the export written
#   eval        `emapg eval --device cuda` on two published-format fixtures, 2 samples each
#   r1-8k       1 step of DeepSeek-R1-Distill-Qwen-1.5B's shape (untied head, 1.78B, random weights) with 8,192
#               new tokens (no EOS: every row runs the whole budget), gradient checkpointing with prefix sharing;
#               peak memory reserved against the memory plan's (fails when it exceeds the plan by over 15%)
#   vllm-train  3 steps with rollout.backend=vllm in bf16 with sleep mode, eager (no compile), with truncated
#               importance sampling: the figure shows the real bf16 sampler/trainer mismatch (when vllm is installed)
#   vllm-eval   `emapg eval --backend vllm` (when vllm is installed)
#   fsdp2       3 steps on 2 GPUs with torchrun + FSDP2 over NCCL (when there are 2 GPUs; on one GPU the
#               test suite checks FSDP2 on the CPU with gloo)
# Usage: bash scripts/gpu_check.sh   (after scripts/setup.sh, or with EMAPG_TORCH_SPEC=skip on a CUDA torch).
# It writes under $EMAPG_GPU_CHECK_DIR (default: a new folder in /tmp), never into a folder that is not empty.
# A rehearsal on a machine without a GPU: EMAPG_GPU_CHECK_DEVICE=cpu EMAPG_GPU_CHECK_SLACK=6 bash scripts/gpu_check.sh
# runs the same commands on the CPU with 6x the time limits, in fp32 (bf16 autocast crawls on most CPUs; device and
# unit then fail, r1-8k is skipped). EMAPG_GPU_CHECK_ONLY="signal resume" runs only the checks named.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false VLLM_LOGGING_LEVEL=WARNING
OUT=${EMAPG_GPU_CHECK_DIR:-$(mktemp -d /tmp/emapg-gpu-check.XXXXXX)}
[ -z "$(ls -A "$OUT" 2>/dev/null)" ] || { echo "gpu_check: $OUT is not empty; give an empty or new folder"; exit 2; }
case "$OUT" in *[[:space:]]*) echo "gpu_check: $OUT: a folder without spaces, please"; exit 2 ;; esac
mkdir -p "$OUT"
NAMES=(); RESULTS=(); FIGURES=()
DEV=${EMAPG_GPU_CHECK_DEVICE:-cuda}
SLACK=${EMAPG_GPU_CHECK_SLACK:-1}
[[ "$SLACK" =~ ^[1-9][0-9]*$ ]] || { echo "EMAPG_GPU_CHECK_SLACK: a whole number >= 1, got '$SLACK'"; exit 2; }
# resume's equality needs deterministic GPU kernels (cuBLAS's workspace; SDPA's backward may still differ)
export CUBLAS_WORKSPACE_CONFIG=:4096:8

check() {  # check NAME TIMEOUT_SECONDS FIGURE_COMMAND -- COMMAND...: run it, keep its log, record result and figure
  local name=$1 limit=$2 figure=$3
  shift 4
  if [ -n "${EMAPG_GPU_CHECK_ONLY:-}" ] && [[ " $EMAPG_GPU_CHECK_ONLY " != *" $name "* ]]; then
    skip "$name" "not asked (EMAPG_GPU_CHECK_ONLY)"; return
  fi
  echo "== $name (at most ${limit} s)"
  local start=$SECONDS rc
  timeout -k 10 "$((limit * SLACK))" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  local fig=""
  if [ $rc -eq 0 ] && [ -n "$figure" ]; then
    fig=$(eval "$figure" 2>&1) || rc=1  # the figure's own check (a comparison, a file that must exist)
    fig=$(printf '%s' "$fig" | tr '\n|' ';/' | sed 's/;/; /g')  # one table cell
  fi
  local result="pass"
  if [ $rc -eq 124 ]; then result="TIMEOUT"; elif [ $rc -ne 0 ]; then result="FAIL"; fi
  if [ "$result" != "pass" ]; then tail -4 "$OUT/$name.log" | sed 's/^/   /'; fig="${fig:-see $OUT/$name.log}"; fi
  NAMES+=("$name"); RESULTS+=("$result ($((SECONDS - start)) s)"); FIGURES+=("$fig")
  echo "   $result: $fig"
}
skip() { NAMES+=("$1"); RESULTS+=("skipped"); FIGURES+=("$2"); echo "== $1: skipped ($2)"; }

TRAIN=(-m emapg train --config recipes/smoke.yaml device=$DEV export=false eval.size=0 save_every=100)
MP=bf16; SLEEP=true
[ "$DEV" = cpu ] && MP=null && SLEEP=false  # the rehearsal computes in fp32; vLLM's CPU build has no sleep mode
SMALL=(model=smollm2-135m task_args.digits=1 mixed_precision=$MP steps=3 prompts_per_step=8
       micro_batch_prompts=4 rollout.n=4 rollout.max_new_tokens=16 algo.kl=topk_reverse algo.k=32 lr=1e-5)
G="$PY scripts/gpu_checks.py"

check device 5 "tail -1 $OUT/device.log" -- $PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; p = torch.cuda.get_device_properties(0); print(torch.__version__, p.name, f'{p.total_memory / 2**30:.0f} GiB', torch.cuda.device_count(), 'GPU(s)')"
check unit 35 "grep -E 'passed|failed' $OUT/unit.log | tail -1" -- env EMAPG_TEST_DEVICE=cuda $PY -m pytest -q -x \
  -p no:cacheprovider tests/test_kl.py tests/test_logprobs.py tests/test_objective.py tests/test_anchor.py
check signal 35 "$G signal $OUT/signal && $G report $OUT/signal" -- $PY "${TRAIN[@]}" "${SMALL[@]}" --out "$OUT/signal"
check agree 20 "tail -1 $OUT/agree.log" -- $G agree "$DEV"
check resume 40 "$G same $OUT/whole $OUT/parts && test -f $OUT/whole/export/anchor/config.json" -- bash -c "
  $PY ${TRAIN[*]} ${SMALL[*]} steps=2 save_every=1 export=true --out $OUT/whole &&
  $PY ${TRAIN[*]} ${SMALL[*]} steps=1 save_every=1 --out $OUT/parts &&
  $PY -m emapg train --resume $OUT/parts steps=2"
check eval 25 "grep -E '^[|] [^|]+ [|] average [|]' $OUT/eval/eval.md" -- $PY -m emapg eval --model smollm2-135m --task math \
  --device "$DEV" --samples 2 --temperature 1.0 --top-p 0.95 --max-new-tokens 64 --out "$OUT/eval" \
  --data tests/fixtures/evalsets/math500.jsonl tests/fixtures/evalsets/olympiadbench.jsonl
if [ "$DEV" = cpu ]; then
  skip r1-8k "a rehearsal on the CPU: 1.78B parameters and their optimizer state need a GPU's memory"
else
  check r1-8k 220 "$G report $OUT/r1-8k && $G plan $OUT/r1-8k" -- $PY "${TRAIN[@]}" model=random-qwen2.5-r1-1.5b \
    mixed_precision=bf16 save_every=0 steps=1 prompts_per_step=1 micro_batch_prompts=1 rollout.n=2 \
    rollout.max_new_tokens=8192 gradient_checkpointing=true prefix_sharing=true algo.kl=topk_reverse algo.k=32 \
    lr=1e-6 --out "$OUT/r1-8k"
fi
if $PY -c "import vllm" 2>/dev/null; then
  check vllm-train 55 "$G report $OUT/vllm-train" -- $PY "${TRAIN[@]}" "${SMALL[@]}" rollout.backend=vllm \
    rollout.vllm_sleep=$SLEEP rollout.vllm_max_model_len=512 rollout.vllm_enforce_eager=true algo.tis_cap=2 \
    --out "$OUT/vllm-train"
  check vllm-eval 45 "grep -E '^[|] [^|]+ [|] average [|]' $OUT/vllm-eval/eval.md" -- $PY -m emapg eval --model smollm2-135m \
    --task math --device "$DEV" --backend vllm --samples 2 --temperature 1.0 --max-new-tokens 64 --out "$OUT/vllm-eval" \
    --data tests/fixtures/evalsets/math500.jsonl tests/fixtures/evalsets/olympiadbench.jsonl
else
  skip vllm-train "vllm is not installed (pip install -e '.[vllm]' in emapg's clone)"
  skip vllm-eval "vllm is not installed"
fi
if [ "$($PY -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)" -ge 2 ]; then
  check fsdp2 60 "$G report $OUT/fsdp2" -- $PY -m torch.distributed.run --standalone --nproc_per_node 2 \
    "${TRAIN[@]}" "${SMALL[@]}" --out "$OUT/fsdp2"
else
  skip fsdp2 "one GPU (FSDP2 over 2 processes runs on the CPU with gloo in the test suite)"
fi

echo
echo "| check | result | figure |"
echo "|---|---|---|"
failed=0
for i in "${!NAMES[@]}"; do
  echo "| ${NAMES[$i]} | ${RESULTS[$i]} | ${FIGURES[$i]} |"
  case "${RESULTS[$i]}" in pass*|skipped) ;; *) failed=1 ;; esac
done
echo
echo "logs and runs: $OUT"
exit $failed
