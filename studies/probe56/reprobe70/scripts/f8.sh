#!/bin/bash
# f8.sh ID TARGET(torchrun|top|worker)
ID=$1; TARGET=$2; cd /tmp/reprobe/w; R=runs/T_$ID; rm -rf $R
export PYTHONPATH=/tmp/reprobe/repo/src HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT=/tmp/reprobe/out/$ID.txt
( ulimit -v 8000000; exec nice -n 19 /work/main/.venv/bin/python -m emapg train --nproc 2 --config smoke --out $R steps=3000 eval.size=2 eval.every=0 rollout.max_new_tokens=4 prompts_per_step=2 rollout.n=2 micro_batch_prompts=1 save_every=2 ) > $OUT 2>&1 &
TOP=$!
echo "top pid $TOP"
# wait for a checkpoint
for i in $(seq 1 150); do [ -f $R/checkpoints/latest ] && break; sleep 1; done
sleep 1
desc() { local p=$1; for c in $(pgrep -P $p); do echo $c; desc $c; done; }
TREE=$(desc $TOP); echo "tree: $TOP $TREE"; ps -o pid,ppid,cmd -p $TOP $TREE | cut -c1-150
TR=$(for p in $TREE; do ps -o pid=,cmd= -p $p | grep -q "torch.distributed.run" && echo $p; done | head -1)
WK=$(for p in $TREE; do ps -o pid=,ppid=,cmd= -p $p | awk -v t=$TR '$2==t' | grep -q "emapg" && echo $p; done | head -1)
case $TARGET in torchrun) V=$TR;; top) V=$TOP;; worker) V=$WK;; esac
echo "killing $TARGET pid $V at $(date +%T)"; kill -9 $V
S=$(date +%s); wait $TOP; RC=$?; echo "top rc=$RC after $(( $(date +%s)-S ))s"
sleep 15
LEFT=$(for p in $TOP $TREE; do kill -0 $p 2>/dev/null && echo $p; done); echo "left alive: ${LEFT:-none}"
ps -o pid,ppid,cmd -p ${LEFT:-1} | cut -c1-150
echo "--- last output:"; tail -c 1500 $OUT | tr '\r' '\n' | grep -v "^\s*$" | tail -8
ls $R/checkpoints
