# Every case of the probe: id, family, what was done, expected, observed, class. Run: python cases.py
import json, re
from pathlib import Path
H, DL, SW, HG, TB, UM, CR = ("held", "data lost", "silently wrong", "hang", "traceback for a user's mistake",
                             "unclear message", "code run from a folder the user did not write")
C = []
def c(id, fam, did, exp, obs, cls, out=None, repro=None):
    C.append(dict(id=id, family=fam, did=did, expected=exp, observed=obs, cls=cls, out=out or id, repro=repro))
REF = "refused, one line, marker not written"
# ---- family 1
c("F1-00", 1, "control: own config u/user_plug.yaml (extends smoke, plugins [plug/evil.py]) train", "imported", "imported (marker written), run ok", H)
for i, (what) in enumerate(["train --config RUN/config.yaml --out new", "train --resume RUN", "plan --config RUN/config.yaml",
                           "eval --run RUN", "export RUN --out elsewhere", "config --show RUN/config.yaml"], 1):
    c(f"F1-0{i}", 1, what + " (RUN's config.yaml names plugins [plug/evil.py])", "refused, one line", "one-line refusal naming plugin + run folder; no marker", H)
c("F1-07", 1, "plan --config RUN/export/dropped.yaml (a file someone put in a run's subfolder)", "refused", "refused one line; no marker", H)
c("F1-08", 1, "plan --config u/rel.yaml (extends: ../runs/F1/config.yaml)", "refused", "refused naming the extended run config; no marker", H)
c("F1-09", 1, "plan --config u/abs.yaml (extends: absolute path of run config)", "refused", "refused; no marker", H)
c("F1-10", 1, "plan --config u/link.yaml (symlink in user folder -> RUN/config.yaml)", "refused", "refused; no marker", H)
c("F1-11", 1, "plan --config u/vialink.yaml (extends: link -> symlink to RUN/config.yaml)", "refused", "refused; no marker", H)
c("F1-12", 1, "plan --config u/chain.yaml (extends rel.yaml which extends run config)", "refused", "refused; no marker", H)
c("F1-13", 1, "plan --config RUN/modplug.yaml (plugins: [evilmod], module on PYTHONPATH)", "refused", "refused; no marker", H)
c("F1-14", 1, "compare --spec specs/base_run.yaml (base: ../runs/F1/config.yaml)", "refused", "refused naming configs.a and the run folder; no marker", H)
c("F1-15", 1, "compare --spec runs/F1/spec_in_run.yaml: a spec FILE inside a run folder; base = shipped smoke.yaml; its overrides add plugins=[plug/evil.py]",
  "refused like any other file in a run folder (the spec is config)", "ran, exit 0; plugin imported twice (loader + run subprocess)", CR)
c("F1-16", 1, "compare --spec specs/user.yaml --out cmp16, where cmp16/a/seed0 already holds a run (checkpoint, no eval.json) whose config.yaml names plugins (put there by someone else); no --trust-plugins",
  "that run's plugins not imported without --trust-plugins", "compare resumed it with `train --resume ... --trust-plugins` it added itself; plugin imported; exit 0", CR)
c("F1-17", 1, "train --resume runs/F1nomark (a run folder copied with `cp -a RUN/* dst/`, so without the hidden .emapg-run marker; config.yaml names plugins)",
  "refused: --resume reads a run folder's config.yaml by definition", "plugin imported, run resumed, exit 0", CR)
c("F1-18", 1, "train --nproc 2 --config RUN/config.yaml", "refused before torchrun", "refused one line; no marker", H)
c("F1-19", 1, "control: train --resume RUN --trust-plugins", "imported", "imported; resumed", H)
c("F1-20", 1, "export runs/F1nomark2 (marker-less copy, as F1-17)", "refused", "plugin imported; export written", CR)
c("F1-21", 1, "compare --report-only on a folder whose runs' configs name plugins", "not imported", "not imported", H)
c("F1-22", 1, "plan --config cmp15/evil_in_cmp.yaml (a config at the top of an `emapg compare --out` folder: emapg wrote runs into it, but it carries no .emapg-run)",
  "arguably refused (a folder emapg wrote runs into)", "imported (borderline: the compare folder itself is not marked)", CR)
# ---- family 2
c("F2-01", 2, "train math, train_file with a 1 MB problem on line 6", "refused fast", "refused in 6 s naming file:line 6, bytes, tokens lower bound", H)
c("F2-02", 2, "train math, 50 MB problem", "refused fast", "refused in 6 s naming line", H)
c("F2-03", 2, "train math, 50 MB problem ('a ' * 25M) with long_prompts=truncate", "cut fast", "cut with warning; run done in 10 s", H)
c("F2-04", 2, "eval --task math --data eval_50mb.jsonl (50 MB row 4)", "refused fast", "refused in 6 s naming line 4", H)
c("F2-05", 2, "plan --config mathbase.yaml task_args.train_file=train_50mb.jsonl", "no hang", "12 s, plan printed", H)
c("F2-06", 2, "same, --device cpu", "no hang", "12 s", H)
c("F2-07", 2, "eval math with a 1,000,000-digit gold answer (lenient grader)", "no hang", "12 s, scored", H)
c("F2-08", 2, "same with --grader reference", "no hang", "7 s", H)
c("F2-09", 2, "index build --corpus corpus_50mb.jsonl (one 50 MB passage)", "refused or cut quickly", "built in 10 s; the passage is stored whole (see F2-11, F2-15 for the consequence)", H)
c("F2-11", 2, "eval --model smollm2-135m --task search_qa over idxN_50mb (corpus whose 50 MB passage matches the questions' names) --data sq_eval_names.jsonl --size 3",
  "the passage cut to max_info_tokens without tokenizing 50 MB", "the rollout tokenizes the whole 50 MB <information> text (rollout/agent.py _add_information cuts after tokenizing): `memory allocation of 800000816 bytes failed` + Rust stack backtrace, rc 134 after 38 s (under a 4 GB cap)", TB)
c("F2-12", 2, "train search_qa with a 50 MB question in train_file", "refused fast", "refused in 7 s naming line 11", H)
c("F2-13", 2, "serve-retriever: POST /retrieve with a 1,000,000-char query", "4xx fast", "400 in 4 ms naming field and limit", H, out="server_curl")
c("F2-14", 2, "serve-retriever: 8,000 queries (16.4 MB body)", "4xx", "400 naming the limit", H, out="server_curl")
c("F2-15", 2, "index dense --index (copy of idx_50mb)", "passage cut before tokenizing", "`memory allocation of 1073741824 bytes failed` + Rust backtrace, rc 134 (under 4 GB cap)", TB)
c("F2-16", 2, "eval math --data eval_50mb.json (JSON list, 50 MB item 3)", "refused", "refused naming item 3", H)
# ---- family 3
c("F3-01", 3, "RUN/checkpoints -> symlink to V1/checkpoints; train --resume RUN keep_checkpoints=1", "refused, V1 unchanged", "refused one line; V1 hash unchanged", H)
c("F3-02", 3, "RUN/checkpoints/step_000004 -> V1's step_000004 (latest names it); resume keep_checkpoints=1", "not used, V1 unchanged, said", "warned twice, resumed own step 2; V1 unchanged (a stray .step_000004.old-* link left in RUN)", H)
c("F3-03", 3, "RUN/checkpoints/latest -> symlink to V1's latest; resume", "refused", "refused one line; V1 unchanged", H)
c("F3-04", 3, "latest -> symlink to V1/checkpoints (a dir); export", "refused", "refused one line", H)
c("F3-05", 3, "export RUN --out RUN/checkpoints/step_000004", "refused", "refused one line, nothing written", H)
c("F3-06", 3, "export RUN --out RUN/checkpoints", "refused", "refused", H)
c("F3-07", 3, "export RUN --out lnk (symlink to RUN/checkpoints/step_000002)", "refused", "refused", H)
c("F3-08", 3, "export R35 --out runs/V1/checkpoints/step_000004 (ANOTHER run's checkpoint folder)", "refused (another run's checkpoints, which its next save prunes)",
  "exit 0, policy/ and anchor/ written inside V1's checkpoint; V1's next resume (keep_checkpoints=1) deleted them without a word", DL)
c("F3-09", 3, "export R36 --out runs/V2/export (ANOTHER run's export folder)", "refused or at least said", "exit 0; V2/export/policy and anchor silently replaced by R36's weights (V2's eval.json no longer matches its export)", DL)
c("F3-10", 3, "RUN/checkpoints/step_000004/policy.safetensors -> V3's file; resume keep_checkpoints=1", "V3 unchanged", "V3 unchanged", H)
c("F3-11", 3, "RUN/metrics.jsonl -> V4's; resume from step 2 (rows after 2 dropped)", "V4 unchanged", "V4 unchanged (link replaced by own file)", H)
c("F3-12", 3, "RUN/tensorboard -> V5/tensorboard, RUN/outcomes -> V5/outcomes; train --resume RUN steps=6", "refused or V5 untouched",
  "V5/outcomes/outcomes.jsonl got RUN's step-6 rows appended and a new event file was written into V5/tensorboard; no warning", SW)
c("F3-13", 3, "export RUN whose checkpoints/ -> V1/checkpoints", "refused", "refused one line", H)
c("F3-14", 3, "export R32b --step 4 where R32b/checkpoints/step_000004 -> V1's step_000004", "refused or warned (resume calls it 'not this run's checkpoint')",
  "exit 0, no warning: V1's weights exported as R32b's step 4", SW)
c("F3-15", 3, "export R32b (default step) with the same link", "not used, said", "warned, exported own older checkpoint", H)
c("F3-16", 3, "export R31 --step 4 where R31/checkpoints -> V1/checkpoints", "refused like F3-13", "exit 0, no warning: V1's step 4 exported as R31's", SW)
c("F3-17", 3, "RUN/export -> V6/export; train --resume RUN steps=6 (export: true)", "refused or V6 untouched", "V6/export/policy and anchor silently replaced by RUN's step-6 models", DL)
# ---- family 4
f4 = {"F4-01": ("optimizer param_groups = []", H, "warned, fell back to step 2"),
      "F4-02": ("param_groups = null", H, "warned, fell back"),
      "F4-03": ("param_groups[0].lr = 'abc'", H, "resumed at 4; the value is unused (the scheduler sets lr), saved state has lr 0.001"),
      "F4-04": ("param_groups[0].params[0] renamed to 'no.such.param'", TB, "resumed at step 4 then RuntimeError traceback in Adam (size 64 vs 259); it then prints 'resume with: emapg train --resume ...', which hits the same checkpoint again"),
      "F4-05": ("optimizer = null", H, "warned, fell back"), "F4-06": ("state.json = null", H, "warned, fell back"),
      "F4-07": ("state.json = [1, 2]", H, "warned, fell back"), "F4-08": ("step = 'four'", H, "warned, fell back"),
      "F4-09": ("step = -3", H, "warned, fell back"), "F4-10": ("state.json truncated", H, "warned, fell back"),
      "F4-11": ("scheduler = null", H, "warned, fell back"), "F4-12": ("scheduler.last_epoch = 'x'", H, "warned, fell back"),
      "F4-13": ("policy.safetensors truncated to half", H, "warned, fell back"), "F4-14": ("anchor.safetensors cut to 100 bytes", H, "warned, fell back"),
      "F4-15": ("optimizer.safetensors 0 bytes", H, "warned, fell back"), "F4-16": ("policy.safetensors header garbage", H, "warned, fell back"),
      "F4-17": ("policy.safetensors header length 2^62", H, "warned (header too large), fell back"),
      "F4-18": ("both checkpoints' policy truncated", H, "one error line: no intact checkpoint; files kept"),
      "F4-19": ("checkpoints/latest is a directory", H, "refused one line, nothing changed"),
      "F4-20": ("latest = null", H, "warned, newest complete checkpoint used"), "F4-21": ("latest = [..]", H, "warned, fallback"),
      "F4-22": ("latest.checkpoint = 4 (int)", H, "warned, fallback"), "F4-23": ("latest names ../../V1/checkpoints/step_000004", H, "warned (not this run's), fallback"),
      "F4-24": ("latest names a missing step_000009", H, "warned, fallback"),
      "F4-25": ("metrics.jsonl line 2 has a stray 0xff", H, "refused one line naming line 2, 'nothing was rewritten'"),
      "F4-26": ("metrics.jsonl last line non-UTF-8", H, "refused one line naming line 6"),
      "F4-27": ("RUN/config.yaml = 'null'", UM, "'config file .../config.yaml: the file is empty (give at least one key ... or leave --config out for the defaults)': the file is not empty, and --config advice does not apply to --resume"),
      "F4-28": ("resumes.jsonl garbage bytes", H, "resumed; garbage kept, new record appended"),
      "F4-29": ("outcomes/heldout.ids.json = null", H, "resumed; file regenerated with the right ids (no warning; nothing of value lost)"),
      "F4-30": ("outcomes/outcomes.jsonl with a 0xff byte", TB, "UnicodeDecodeError traceback from run/evaluate.py forget_after"),
      "F4-31": ("finished.json = []", H, "resumed fine"),
      "F4-32": ("outcomes.jsonl rows {'step':'x'}, null, [1]", TB, "TypeError traceback ('<=' not supported between str and int)"),
      "F4-33": ("eval.json = null", H, "resumed, rewritten at end (an output)"),
      "F4-34": ("export --step 4 with policy truncated", H, "one line naming the damaged file"),
      "F4-35": ("export (default step) with newest policy truncated", H, "one line naming the damaged file (no fallback, but clear)")}
for k, (d, cl, o) in f4.items():
    cmd = "export" if k in ("F4-34", "F4-35") else "train --resume RUN steps=6"
    c(k, 4, f"copy of a finished 4-step run, {d}; {cmd}", "one clear line or fallback to the previous checkpoint; no traceback; no silent loss", o, cl)
# ---- family 5
f5 = {"F5-hid1e6": ("hidden_size 10^6 (no head_dim)", H, "one line: too wide to measure, cannot plan"),
      "F5-hid1e6_hd": ("hidden_size 10^6 with head_dim 16", TB, "RuntimeError traceback: DefaultCPUAllocator can't allocate 512000000 bytes (plan.py _layers_model measures a real layer; under a 4 GB cap)"),
      "F5-layers1e9": ("num_hidden_layers 10^9", TB, "ran 87 s building layers on meta, then SystemError traceback (Linear.__init__ returned NULL) at the 4 GB cap"),
      "F5-layers1e6": ("num_hidden_layers 10^6", TB, "86 s, same SystemError traceback at the 4 GB cap"),
      "F5-layers_neg": ("num_hidden_layers -4", H, "one line"), "F5-hid_zero": ("hidden_size 0", H, "one line"),
      "F5-vocab1e12": ("vocab_size 10^12", H, "plan table, nothing fits (no allocation)"), "F5-vocab_neg": ("vocab_size -5", H, "one line"),
      "F5-heads_zero": ("num_attention_heads 0", TB, "ZeroDivisionError traceback"),
      "F5-hid_float": ("hidden_size 64.5", H, "one line"), "F5-hid_str": ("hidden_size 'big'", H, "one line"),
      "F5-inter1e15": ("intermediate_size 10^15", H, "one line"), "F5-hid1e30": ("hidden_size 10^30", H, "one line (overflow named)"),
      "F5-layers_true": ("num_hidden_layers true", H, "one line"),
      "F5-cfg_null": ("config.json = null", H, "one line"), "F5-cfg_list": ("config.json = [1,2]", H, "one line"),
      "F5-cfg_empty": ("config.json empty", H, "one line"), "F5-cfg_nonutf8": ("config.json = 0xff", H, "one line"),
      "F5-cfg_num": ("config.json = 42", H, "one line"),
      "F5-ptok": ("plan --config smoke --prompt-tokens 10^12", H, "plan printed, nothing fits"), "F5-gpus0": ("plan --gpus 0", H, "one line")}
for k, (d, cl, o) in f5.items():
    c(k, 5, f"emapg plan model=models/X with config.json {d}" if not k.endswith(("ptok", "gpus0")) else d, "one line, no huge allocation", o, cl)
# ---- family 6
for k, d in [("F6-dup_top", "top-level steps twice"), ("F6-dup_nested", "algo.eta twice (block)"), ("F6-dup_flow", "algo {eta, eta} flow map"),
             ("F6-dup_child", "duplicate in an extended parent"), ("F6-dup_complex", "'? steps' complex-key duplicate"),
             ("F6-dup_taskargs", "task_args {digits, digits}"), ("F6-spec-dup", "compare spec configs.a twice"), ("F6-resume-dup", "RUN/config.yaml with steps appended twice, --resume")]:
    c(k, 6, f"duplicate YAML key: {d}", "refused naming both lines", "refused naming both lines and the file", H)
c("F6-merge_key", 6, "YAML merge key (algo: {<<: *b, eta: 0.5})", "refused or applied with a clear line", "refused: 'could not determine a constructor for the tag tag:yaml.org,2002:merge' (YAML jargon; does not say merge keys are unsupported)", UM)
c("F6-intkey", 6, "config with a numeric top-level key (`1: a`), train", "one line naming the key", "TypeError traceback (settings.py typed: sequence item 0: expected str instance, int found)", TB)
c("F6-intkey_nested", 6, "config with algo: {1: 2}, train", "one line", "same TypeError traceback", TB)
c("F6-dup_intstr", 6, "config with keys 1 and \"1\", config --show", "one line", "TypeError traceback ('<' not supported between str and int)", TB)
c("F6-conc", 6, "two concurrent index build --out idx_conc", "one refused", "second refused naming the writer's PID; first ok", H, out="F6-conc-b")
c("F6-conc2", 6, "two concurrent index build: --out idx_conc2 and --out idxlink (a symlink to idx_conc2)", "one refused (same folder)",
  "both exit 0: the lock is per given name; the second replaced the symlink idxlink with a separate folder (link left as .idxlink.old-*), so idx_conc2 holds the other corpus", SW, out="F6-conc2-b")
c("F6-G1", 6, "math_reward('The answer is \\boxed{N}.', N), N = 4,500 random digits", "1", "1.0 in 0.04 s", H, out="F6-grader")
c("F6-G2", 6, "variants: \\boxed{$N$}, negative, gold with thousands commas, leading zeros, spaces, 2000.2500-digit decimal, reference grader, worker thread", "1", "all 1.0", H, out="F6-grader")
c("F6-G6", 6, "boxed N with last digit changed", "0", "0.0", H, out="F6-grader")
c("F6-G9", 6, "identical 4,500-digit answer written without \\boxed ('So the answer is N')", "1 (as it is for 4,200 digits)", "0.0 at 4,400 and 4,500 digits, 1.0 at 4,200 (grader2)", SW, out="F6-grader2")
c("F6-G11", 6, "boxed N against gold 'N.0', and \\boxed{\\frac{N}{1}} against N, 4,500 digits", "1 (as for <= 4,200 digits)", "0.0 beyond ~4,300 digits, 1.0 at 4,200", SW, out="F6-grader2")
c("F6-cmp-stale", 6, "compare --spec specs/eta05.yaml (config a: algo.eta=0.5 lr=0.5 steps=4) --out cmp_sw, where cmp_sw/a/seed0 is a finished run of another config (eta 0.9, lr 0.001)",
  "the mismatch refused or said", "'a seed 0: done already'; its results reported as config a's; exit 0", SW)
# ---- family 7
c("F7-01", 7, "child.yaml extends parent_bad.yaml (algo.eta 2.0)", "blamed on parent_bad.yaml", "blamed on ext/parent_bad.yaml", H)
c("F7-02", 7, "grandchild -> child -> parent_bad", "blamed on parent_bad.yaml", "blamed on parent", H)
c("F7-03", 7, "bad values in both child (steps) and parent (lr, rollout.n)", "each blamed on its file", "each blamed on its file", H)
c("F7-04", 7, "parent's task_args.digits -3", "blamed on parent", "blamed on parent", H)
c("F7-05", 7, "override algo.eta=3 over child", "blamed on override", "blamed on the override", H)
c("F7-06", 7, "parent sets micro_batch_prompts 3 vs prompts_per_step 4", "blamed on parent", "blamed on parent", H)
c("F7-07", 7, "parent weight_ema 0.5, child algo.eta 0.9", "blamed sensibly", "blamed on parent, states both", H)
c("F7-spec-empty_configs", 7, "compare spec configs: {}", "non-zero, one line", "refused one line", H)
c("F7-spec-empty_seeds", 7, "compare spec seeds: []", "non-zero, one line", "refused one line", H)
c("F7-spec-configs_null", 7, "spec configs: (null)", "one line", "one line", H)
c("F7-spec-seeds_scalar", 7, "spec seeds: 0", "one line", "one line", H)
c("F7-spec-groups_unknown", 7, "spec groups naming an unknown config", "one line", "one line", H)
c("F7-ro-empty", 7, "compare --spec specs/user.yaml --out cmp_emptydir --report-only (existing empty folder)", "non-zero or a line saying no runs were found",
  "exit 0 with no output at all; writes an empty results.md and summary.json = {}", SW)
c("F7-ro-missing", 7, "compare --report-only --out cmp_nonexist (no such folder)", "a line saying the folder has no runs", "'emapg: error: cmp_nonexist/summary.json: No such file or directory' (names a file the user never made; does not say there are no runs)", UM)
c("F7-size3-math", 7, "eval --task math --data eval_50mb_last.jsonl --size 3 (50 MB row is line 6)", "evaluates 3 rows", "evaluated 3 rows, 7 s", H)
c("F7-size3-search", 7, "eval --task search_qa --data sq_eval_1mb.jsonl --size 3 (1 MB row 4)", "evaluates 3 rows", "ok", H)
c("F7-size-train", 7, "train math with eval_file = eval_50mb_last.jsonl and eval.size=3", "(not required) ", "refused naming line 6, which would never be evaluated (clear, but stricter than eval --size)", H)
c("F7-ans-null-eval", 7, "search eval row with answers: null", "one line", "one line naming file:line:field", H)
c("F7-ans-null-train", 7, "search train row with answers: null", "one line", "one line", H)
for i, d in enumerate(["answers: []", "answers: [null]", "answers: 'Land3' (string)", "answers: 5", "question: null", "answers: [{a:1}]"]):
    c(f"F7-sqbad{i}", 7, f"search eval row {d}", "one line or accepted sensibly", "one line" if i not in (2, 3) else "accepted (scalar answer taken as one answer)", H)
c("F7-plug-cd_annot", 7, "plugin task whose __init__ annotation is NoSuchType; task chosen by override task=cd_annot on --config smoke", "one line naming the plugin",
  "one line naming the plugin and the NameError, but prefixed with '.../recipes/smoke.yaml: task cd_annot' — blames the shipped recipe, which does not name that task (the override does)", UM)
c("F7-plug-cd_str", 7, "plugin train_examples returns a string", "one line naming the plugin", "one line naming Countdown in cd_str.py", H)
c("F7-plug-cd_dicts", 7, "plugin train_examples returns dicts", "one line", "one line", H)
c("F7-plug-cd_rew", 7, "plugin reward returns 'yes'", "one line", "one line naming the task and sample", H)
c("F7-plug-cd_evnone", 7, "plugin eval_examples returns None", "one line naming the plugin", "TypeError traceback (run/evaluate.py __init__: 'NoneType' object is not iterable)", TB)
c("F7-plug-cd_annot2", 7, "plugin method with an unresolvable annotation (train_examples n: Missing[int])", "no effect or one line", "runs (annotations lazy)", H)
c("F7-surr", 7, "serve-retriever (bm25, offline): query with a lone surrogate \\ud800", "4xx naming the field", "400 'field queries: query 0 holds a lone surrogate'", H, out="server_curl")
c("F7-surr3", 7, "lone low surrogate in query 1 of 2", "4xx", "400 naming query 1", H, out="server_curl")
c("F7-srv-misc", 7, "topk '3' (string), body without queries, non-UTF-8 body", "4xx each", "400 each with a one-line reason", H, out="server_curl")
# ---- family 8
c("F8-01", 8, "train --nproc 2 ... ; SIGKILL the torch.distributed.run process", "told what happened + how to resume; workers gone",
  "'the torchrun launcher (PID ..) was killed by SIGKILL; its workers stop with it. Continue ...: emapg train --resume RUN --nproc 2'; no process left", H)
c("F8-02", 8, "train --nproc 2 ... ; SIGKILL the `emapg train --nproc 2` process itself", "told what happened + how to resume",
  "workers stopped and 'the run stopped at step 14; resume with: emapg train --resume RUN' printed (without --nproc 2), then 'terminated (SIGTERM)' and a torch SignalException traceback as the last lines; nothing says the launcher was SIGKILLed; resume with --nproc 2 worked", UM)
c("F8-03", 8, "train --nproc 2 ... ; SIGKILL the rank-0 worker (as the OOM killer would)", "told what happened + how to resume",
  "only torch's ChildFailedError report (traceback + 'exitcode -9 (SIGKILL)'); no emapg line, no resume hint; `train --resume` worked afterwards", UM)

def tail(name, n=3):
    p = Path("/tmp/reprobe/out") / f"{name}.txt"
    if not p.exists(): return ""
    lines = [l for l in p.read_text(errors="replace").replace("\r", "\n").splitlines() if l.strip() and "step/s" not in l and "problem/s" not in l]
    return " | ".join(l.strip()[:240] for l in lines[-n:])
for x in C:
    x["output_tail"] = tail(x["out"])
counts = {}
for x in C: counts[x["cls"]] = counts.get(x["cls"], 0) + 1
Path("/tmp/reprobe/results.json").write_text(json.dumps({"commit": open("/tmp/reprobe/commit").read().strip(), "counts": counts, "cases": C}, indent=1))
esc = lambda s: str(s).replace("|", "\\|").replace("\n", " ")
rows = "\n".join(f"| {x['id']} | {x['family']} | {esc(x['did'])} | {esc(x['expected'])} | {esc(x['observed'])} | **{x['cls']}** |" for x in C)
print(json.dumps(counts, indent=1), len(C))
Path("/tmp/reprobe/cases_table.md").write_text("| id | fam | what I did | expected | observed | class |\n|---|---|---|---|---|---|\n" + rows + "\n")
