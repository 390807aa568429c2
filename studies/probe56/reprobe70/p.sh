#!/bin/bash
# usage: p.sh ID cmd...   (runs in /tmp/reprobe/w)
ID=$1; shift
export PYTHONPATH=/tmp/reprobe/repo/src HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PATH=/work/main/.venv/bin:$PATH
cd /tmp/reprobe/w
S=$(date +%s.%N)
( ulimit -v 4000000; nice -n 19 timeout 180 bash -c "$*" ) > /tmp/reprobe/out/$ID.txt 2>&1
RC=$?
E=$(echo "$(date +%s.%N) - $S" | bc)
echo "rc=$RC t=${E}s" >> /tmp/reprobe/out/$ID.txt
echo "[$ID] rc=$RC t=${E}s :: $*" >> /tmp/reprobe/out/_log.txt
tail -n ${TAILN:-8} /tmp/reprobe/out/$ID.txt
