#!/bin/bash
# Rebuilds the fixtures this probe used, under /tmp/reprobe/w (as run during the probe).
set -e; cd /tmp/reprobe/w; PY=/work/main/.venv/bin/python
export PYTHONPATH=/tmp/reprobe/repo/src HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p plug data u ext specs models myplug runs
cat > plug/evil.py <<'P'
import os, sys, time
with open("/tmp/reprobe/markers/hit", "a") as f:
    f.write(f"{time.time()} {os.getpid()} {' '.join(sys.argv)}\n")
P
mkdir -p /tmp/reprobe/markers; cp plug/evil.py plug/evilmod.py
$PY - <<'P'
import json
def w(p, rs):
    with open(p, "w") as f:
        for r in rs: f.write(json.dumps(r) + "\n")
norm = lambda n, off=0: [{"problem": f"What is {i+off} + {i+1}?", "answer": str(2*i+1+off)} for i in range(n)]
w("data/train_ok.jsonl", norm(20)); w("data/eval_ok.jsonl", norm(10, 100))
w("data/train_1mb.jsonl", norm(5) + [{"problem": "What is " + "1 + " * 250000 + "1?", "answer": "2"}] + norm(5, 50))
w("data/train_50mb.jsonl", norm(5) + [{"problem": "x" * 50_000_000, "answer": "2"}] + norm(5, 50))
w("data/eval_50mb.jsonl", norm(3, 100) + [{"problem": "x" * 50_000_000, "answer": "2"}])
w("data/eval_50mb_last.jsonl", norm(5, 100) + [{"problem": "x" * 50_000_000, "answer": "2"}])
rows = [{"id": str(i), "title": f"T{i}", "text": f"Entity{i} is the capital of Land{i}."} for i in range(30)]
w("data/corpus_ok.jsonl", rows)
w("data/corpus_50mb.jsonl", rows[:10] + [{"id": "big", "title": "Big", "text": "word " * 10_000_000}] + rows[10:])
names = ['Kadrin','Ostavia','Tomas','Verl','Marlow','Brenna','Eutopia','Paris','France','Berlin','Danube','Everest']
words = ' '.join(names) + ' city country capital born '
big = (words * (50_000_000 // len(words) + 1))[:50_000_000]
w("data/corpusN_50mb.jsonl", [{'id':'a','title':'A','text':'alpha beta'},{'id':'big','title':'Big','text':big},{'id':'c','title':'C','text':'gamma delta'}])
w("data/sq_eval_names.jsonl", [{'question':'In which country is the city of Kadrin?','answers':['Ostavia']},{'question':'Where was Tomas Verl born?','answers':['Kadrin']},{'question':'Which river flows through Berlin?','answers':['Spree']}])
P
cat > mathbase.yaml <<'Y'
extends: smoke
task: math
task_args: {train_file: data/train_ok.jsonl, eval_file: data/eval_ok.jsonl, template: plain}
steps: 2
eval: {size: 2, every: 2}
rollout: {n: 2, max_new_tokens: 4}
prompts_per_step: 2
micro_batch_prompts: 1
Y
cat > u/user_plug.yaml <<'Y'
extends: smoke
plugins: [/tmp/reprobe/w/plug/evil.py]
steps: 2
eval: {size: 2, every: 2}
rollout: {n: 2, max_new_tokens: 4}
prompts_per_step: 2
micro_batch_prompts: 1
Y
