#!/usr/bin/env bash
# The GPU acceptance run: every check runs even when an earlier one fails; one table at the end (check, result,
# figure). Figures come from scripts/gpu_checks.py. Each check's time limit is derived below from a stated model of
# its work (process starts, model loads, tokens decoded, bytes written) times MARGIN, so that a TIMEOUT means a
# defect, not a slow disk or a cold cache; the work of the checks on one GPU adds to at most 540 s, what a 15-minute
# device lease leaves after a cold start of up to 5 minutes and the transfers (tests/test_house.py reads
# EMAPG_GPU_CHECK_PLAN=1's table). The checks:
#   device      the GPU torch sees
#   unit        the estimator, log-prob, objective and anchor tests with every tensor on CUDA (float64 enumeration)
#   signal      3 steps of SmolLM2-135M on one-digit additions, bf16 autocast: some groups get different rewards,
#               so the policy gradient runs (a random model scores 0 everywhere)
#   agree       one micro-batch's loss, bf16 autocast against fp32, the same rollout
#   resume      2 steps in one go against 1 step + a resume to 2: the same policy and anchor; the export written
#   eval        `emapg eval --device cuda` on two published-format fixtures, 2 samples each
#   r1-4k       1 step of DeepSeek-R1-Distill-Qwen-1.5B's shape (untied head, 1.78B, random weights) with 4,096
#               new tokens (no EOS: every row runs the whole budget), gradient checkpointing with prefix sharing;
#               peak memory reserved against the memory plan's (fails when it exceeds the plan by over 15%)
#   vllm-recipe the paper's 8k math recipe with its own flags (prefix sharing, gradient checkpointing, vLLM with
#               sleep mode, recompute_old, low_var_kl, mask_truncated, bf16) at 2,048 new tokens, 2 steps of
#               SmolLM2-135M (offload needs 2 processes: on one GPU it is off); fails when vLLM is missing, since
#               the recipes need it; the figure shows the real bf16 sampler/trainer mismatch
#   vllm-eval   `emapg eval --backend vllm` (fails when vLLM is missing)
#   fsdp2       with 2 GPUs: the same recipe flags with offload on, torchrun + FSDP2, NCCL for CUDA tensors and
#               gloo for the offloaded CPU shards, a vLLM engine per rank (on one GPU the test suite checks FSDP2
#               on the CPU with gloo, every recipe on 2 and 3 processes)
# Usage: bash scripts/gpu_check.sh   (after scripts/setup.sh, or with EMAPG_TORCH_SPEC=skip on a CUDA torch).
# It writes under $EMAPG_GPU_CHECK_DIR (default: a new folder in /tmp), never into a folder that is not empty.
# A rehearsal on a machine without a GPU: EMAPG_GPU_CHECK_DEVICE=cpu EMAPG_GPU_CHECK_SLACK=6 bash scripts/gpu_check.sh
# runs the same commands on the CPU with 6x the time limits, in fp32 (bf16 autocast crawls on most CPUs; device and
# unit then fail, r1-4k is skipped). EMAPG_GPU_CHECK_ONLY="signal resume" runs only the checks named (the others
# are skipped, and the exit status is the named checks' own). EMAPG_GPU_CHECK_PLAN=1 prints each check's modelled
# work and limit and runs nothing.
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

# The model of the work (a fresh single-GPU H100 machine at the slow end of what we plan for), in seconds and MB:
MARGIN=2       # each limit is twice its modelled work
START=10       # a Python process importing torch, transformers and emapg, and its first CUDA context
COLD=15        # the first CUDA context on a fresh machine (driver load, no persistence daemon): the device check
LOAD=5         # SmolLM2-135M converted from its GGUF (cached after the first) and moved to the GPU
STEP=3         # one training step of the small runs (8 prompts x 4 responses x 16 tokens, 135M, bf16)
DISK=250       # MB/s of fsync'd writes (a network disk)
CKPT=2200      # MB of one SmolLM2-135M checkpoint: policy, anchor and AdamW's two moments in fp32
EXPORTED=1100  # MB of an export: the policy and the anchor
TOKEN_MS=25    # ms a token of the 1.78B model's eager decode (one forward a token)
VLLM=45        # a cold vLLM engine: load, memory profile, KV cache (eager), or compile and capture graphs
W_device=$((START + COLD))
W_unit=$((START + 20))                                           # the 4 test files' ~400 tests on CUDA
W_signal=$((START + LOAD + 3 * STEP))
W_agree=$((START + LOAD + 5))                                    # one rollout and two passes
W_resume=$((3 * (START + LOAD) + 4 * STEP + (4 * CKPT + EXPORTED) / DISK))  # 3 launches, 4 steps, 4 saves, 1 export
W_eval=$((START + LOAD + 10))                                    # 2 fixtures x 2 samples x 64 tokens
W_r1=$((START + 10 + 4096 * TOKEN_MS / 1000 + 20))               # init the random 1.78B model, decode, the passes
W_vllm_recipe=$((START + VLLM + 20 + 5 + 10))                    # engine, 2 rollouts of 8 x 2,048, sleep/wake, passes
W_vllm_eval=$((START + VLLM + 15))
W_fsdp2=$((START + 2 * VLLM + 20 + 20))                          # two engines, offloaded passes, 2 rollouts
limit() { echo $((MARGIN * $1)); }

asked() { [ -z "${EMAPG_GPU_CHECK_ONLY:-}" ] || [[ " $EMAPG_GPU_CHECK_ONLY " == *" $1 "* ]]; }
check() {  # check NAME WORK_SECONDS FIGURE_COMMAND -- COMMAND...: run it (limit: MARGIN x its work), keep its log,
  local name=$1 limit work=$2 figure=$3  # record result and figure
  limit=$(limit "$work")
  shift 4
  if [ -n "${EMAPG_GPU_CHECK_PLAN:-}" ]; then echo "$name $work $limit"; return; fi
  if ! asked "$name"; then
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
fail() {  # a check that cannot run (vLLM missing): FAIL when it was asked for, else skipped as not asked
  if [ -n "${EMAPG_GPU_CHECK_PLAN:-}" ]; then return; fi
  if ! asked "$1"; then skip "$1" "not asked (EMAPG_GPU_CHECK_ONLY)"; return; fi
  NAMES+=("$1"); RESULTS+=("FAIL"); FIGURES+=("$2"); echo "== $1: FAIL ($2)"
}

TRAIN=(-m emapg train --config recipes/smoke.yaml device=$DEV export=false eval.size=0 save_every=100)
MP=bf16; SLEEP=true
[ "$DEV" = cpu ] && MP=null && SLEEP=false  # the rehearsal computes in fp32; vLLM's CPU build has no sleep mode
SMALL=(model=smollm2-135m task_args.digits=1 mixed_precision=$MP steps=3 prompts_per_step=8
       micro_batch_prompts=4 rollout.n=4 rollout.max_new_tokens=16 algo.kl=topk_reverse algo.k=32 lr=1e-5)
G="$PY scripts/gpu_checks.py"

check device $W_device "tail -1 $OUT/device.log" -- $PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; p = torch.cuda.get_device_properties(0); print(torch.__version__, p.name, f'{p.total_memory / 2**30:.0f} GiB', torch.cuda.device_count(), 'GPU(s)')"
check unit $W_unit "grep -E 'passed|failed' $OUT/unit.log | tail -1" -- env EMAPG_TEST_DEVICE=cuda $PY -m pytest -q -x \
  -p no:cacheprovider tests/test_kl.py tests/test_logprobs.py tests/test_objective.py tests/test_anchor.py
check signal $W_signal "$G signal $OUT/signal && $G report $OUT/signal" -- $PY "${TRAIN[@]}" "${SMALL[@]}" --out "$OUT/signal"
check agree $W_agree "tail -1 $OUT/agree.log" -- $G agree "$DEV"
check resume $W_resume "$G same $OUT/whole $OUT/parts && test -f $OUT/whole/export/anchor/config.json" -- bash -c "
  $PY ${TRAIN[*]} ${SMALL[*]} steps=2 save_every=1 export=true --out $OUT/whole &&
  $PY ${TRAIN[*]} ${SMALL[*]} steps=1 save_every=1 --out $OUT/parts &&
  $PY -m emapg train --resume $OUT/parts steps=2"
check eval $W_eval "grep -E '^[|] [^|]+ [|] average [|]' $OUT/eval/eval.md" -- $PY -m emapg eval --model smollm2-135m --task math \
  --device "$DEV" --samples 2 --temperature 1.0 --top-p 0.95 --max-new-tokens 64 --out "$OUT/eval" \
  --data tests/fixtures/evalsets/math500.jsonl tests/fixtures/evalsets/olympiadbench.jsonl
if [ "$DEV" = cpu ] && [ -z "${EMAPG_GPU_CHECK_PLAN:-}" ]; then
  skip r1-4k "a rehearsal on the CPU: 1.78B parameters and their optimizer state need a GPU's memory"
else
  check r1-4k $W_r1 "$G report $OUT/r1-4k && $G plan $OUT/r1-4k" -- $PY "${TRAIN[@]}" model=random-qwen2.5-r1-1.5b \
    mixed_precision=bf16 save_every=0 steps=1 prompts_per_step=1 micro_batch_prompts=1 rollout.n=2 \
    rollout.max_new_tokens=4096 gradient_checkpointing=true prefix_sharing=true algo.kl=topk_reverse algo.k=32 \
    lr=1e-6 --out "$OUT/r1-4k"
fi
RECIPE=(-m emapg train --config recipes/math_r1_distill_1p5b.yaml device=$DEV model=smollm2-135m mixed_precision=$MP
        task_args.train_file=tests/fixtures/evalsets/deepscaler_train.json
        task_args.eval_file=tests/fixtures/evalsets/aime_2024.jsonl steps=2 prompts_per_step=2 mini_batch_prompts=2
        rollout.n=4 rollout.max_new_tokens=2048 rollout.backend_args.max_model_len=3072
        rollout.backend_args.enforce_eager=true rollout.backend_args.sleep=$SLEEP eval.size=0 eval.max_new_tokens=2048 save_every=0
        export=false)
if [ -n "${EMAPG_GPU_CHECK_PLAN:-}" ] || $PY -c "import vllm" 2>/dev/null; then
  check vllm-recipe $W_vllm_recipe "$G report $OUT/vllm-recipe" -- $PY "${RECIPE[@]}" offload=false --out "$OUT/vllm-recipe"
  check vllm-eval $W_vllm_eval "grep -E '^[|] [^|]+ [|] average [|]' $OUT/vllm-eval/eval.md" -- $PY -m emapg eval --model smollm2-135m \
    --task math --device "$DEV" --backend vllm --samples 2 --temperature 1.0 --max-new-tokens 64 --out "$OUT/vllm-eval" \
    --data tests/fixtures/evalsets/math500.jsonl tests/fixtures/evalsets/olympiadbench.jsonl
else
  fail vllm-recipe "vllm is not installed (pip install -e '.[vllm]' in emapg's clone): the paper's recipes need it"
  fail vllm-eval "vllm is not installed"
fi
if [ -n "${EMAPG_GPU_CHECK_PLAN:-}" ] || [ "$($PY -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)" -ge 2 ]; then
  check fsdp2 $W_fsdp2 "$G report $OUT/fsdp2" -- $PY -m torch.distributed.run --standalone --nproc_per_node 2 \
    "${RECIPE[@]}" offload=true --out "$OUT/fsdp2"
else
  skip fsdp2 "one GPU (FSDP2 over 2 and 3 processes runs on the CPU with gloo in the test suite: tests/test_recipe_matrix.py)"
fi

[ -n "${EMAPG_GPU_CHECK_PLAN:-}" ] && { rmdir "$OUT" 2>/dev/null; exit 0; }
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
