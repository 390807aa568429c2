#!/usr/bin/env python3
"""Adversarial probe of the `emapg` CLI (issue 56's second probe, 385 cases), rerunnable.

    .venv/bin/python studies/probe56/probe.py                        # every case (about 30 min on 2 cores)
    .venv/bin/python studies/probe56/probe.py --only r3_state_list,r6_ans_open
    .venv/bin/python studies/probe56/probe.py --root 6               # one root
    EMAPG_SRC=../other/src .venv/bin/python studies/probe56/probe.py  # probe another source tree

Each case is a small function that sets up files in its own folder under $EMAPG_PROBE_DIR/cases/<case>/ (default
/tmp/probe), runs emapg (or a few lines of Python against emapg's modules) in a child process with a wall-clock
timeout (a hang is detected and the process group killed), and classifies the outcome:

    held | data lost | silently wrong result | hang (timed out) | traceback for a user's mistake | unclear message

It probes this checkout's src/ unless EMAPG_SRC names another; results go to $EMAPG_PROBE_DIR/results.json
(written after every case) and REPORT.md there. The counts of each run are in studies/probe56/README.md.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import resource
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import traceback
from pathlib import Path

PROBE = Path(os.environ.get("EMAPG_PROBE_DIR", "/tmp/probe"))
SRC = Path(os.environ.get("EMAPG_SRC", Path(__file__).resolve().parents[2] / "src"))
PY = os.environ.get("EMAPG_PY", sys.executable)
CASES_DIR = PROBE / "cases"
FIX = PROBE / "fixtures"
RESULTS = PROBE / "results.json"
SMOKE = SRC / "emapg/recipes/smoke.yaml"
DEFAULT_TIMEOUT = 120
AS_LIMIT = 4 * 2**30  # address-space cap for every child: a runaway read cannot eat the shared machine
T_SPECIAL = 30  # a FIFO or device read should answer at once: 30 s means it never will

HELD, LOST, WRONG, HANG, TB, UNCLEAR, PROBE_ERR = (
    "held", "data lost", "silently wrong result", "hang (timed out)", "traceback for a user's mistake",
    "unclear message", "probe error")
CLASSES = [HELD, LOST, WRONG, HANG, TB, UNCLEAR]

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(SRC),
       "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
       "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1"}
ENV.pop("EMAPG_RUN_LOCK", None)
ENV.pop("EMAPG_LAUNCHER_PID", None)

# a tiny smoke run: 2 steps of 2 prompts x 2 samples, 4 new tokens, 2 held-out problems
TINY = ["steps=2", "eval.size=2", "rollout.max_new_tokens=4", "prompts_per_step=2", "rollout.n=2",
        "micro_batch_prompts=1", "eval.every=2", "save_every=1", "export=false"]


# ---------------------------------------------------------------------------------------------------------
# running things

class Result:
    def __init__(self, cmd, rc, out, err, timed_out, seconds, timeout):
        self.cmd, self.rc, self.out, self.err = cmd, rc, out, err
        self.timed_out, self.seconds, self.timeout = timed_out, seconds, timeout

    @property
    def text(self) -> str:
        return (self.err or "") + "\n" + (self.out or "")

    def tail(self, n: int = 12) -> str:
        return tail_lines(self.err + ("\n--- stdout ---\n" + self.out if self.out.strip() else ""), n)


def tail_lines(text: str, n: int = 12) -> str:
    lines = [ln.rstrip() for ln in re.split(r"[\r\n]+", text) if ln.strip()]
    lines = [ln for ln in lines if not re.search(r"\d+%\|", ln)]  # progress bars
    return "\n".join(ln[:400] for ln in lines[-n:])


def _limits(as_limit, fsize):
    def pre():
        os.setsid()
        if as_limit:
            resource.setrlimit(resource.RLIMIT_AS, (as_limit, as_limit))
        if fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    return pre


class Ctx:
    """One case: its folder, its log (the exact reproduction), its outputs."""

    def __init__(self, name: str):
        self.name = name
        self.dir = CASES_DIR / name
        if self.dir.exists():
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True)
        self.repro: list[str] = [f"cd {self.dir}"]
        self.outputs: list[str] = []
        self.cleanup: list = []

    # -- setup, logged
    def note(self, text: str) -> None:
        self.repro.append(f"# {text}")

    def write(self, rel: str, content, show: bool = True) -> Path:
        p = self.dir / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content, encoding="utf-8", errors="surrogatepass")
        if show:
            shown = content if isinstance(content, bytes) else content.encode("utf-8", "surrogatepass")
            more = f" ... ({len(shown)} bytes)" if len(shown) > 300 else ""
            self.repro.append(f"# file {rel} = {shown[:300]!r}{more}")
        return p

    def sh(self, cmd: str) -> None:
        """A setup shell command (logged)."""
        self.repro.append(cmd)
        subprocess.run(cmd, shell=True, cwd=self.dir, check=True, env=ENV)

    def copy_run(self, name: str = "run") -> Path:
        shutil.copytree(FIX / "run", self.dir / name, symlinks=True)
        self.repro.append(f"cp -r {FIX / 'run'} {name}   # a finished 2-step smoke run (checkpoints step 1, 2)")
        return self.dir / name

    # -- running
    def cli(self, args, timeout=DEFAULT_TIMEOUT, stdin=None, as_limit=AS_LIMIT, fsize=None, cwd=None,
            env=None, log=True) -> Result:
        cmd = [PY, "-m", "emapg", *map(str, args)]
        shown = "emapg " + " ".join(shlex.quote(str(a)) for a in args)
        if fsize is not None:
            shown = f"(ulimit -f {fsize // 1024}; {shown})"
        return self._run(cmd, shown, timeout, stdin, as_limit, fsize, cwd, env, log)

    def py(self, code: str, timeout=DEFAULT_TIMEOUT, args=(), as_limit=AS_LIMIT, log=True) -> Result:
        code = textwrap.dedent(code)
        cmd = [PY, "-c", code, *map(str, args)]
        shown = f"python -c {shlex.quote(code.strip())}" + "".join(" " + shlex.quote(str(a)) for a in args)
        return self._run(cmd, shown, timeout, None, as_limit, None, None, None, log)

    def _run(self, cmd, shown, timeout, stdin, as_limit, fsize, cwd, env, log) -> Result:
        if log:
            self.repro.append(shown)
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=cwd or self.dir, env={**ENV, **(env or {})},
                                stdin=subprocess.DEVNULL if stdin is None else stdin,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_limits(as_limit, fsize))
        timed_out = False
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _killpg(proc.pid)
            out, err = proc.communicate()
        r = Result(shown, proc.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"),
                   timed_out, time.monotonic() - t0, timeout)
        if log:
            self.outputs.append(f"$ {shown}\n[exit {r.rc}{f', TIMED OUT after {timeout}s' if timed_out else ''}, "
                                f"{r.seconds:.1f} s]\n{r.tail()}")
        return r

    def popen(self, args, log=True):
        cmd = [PY, "-m", "emapg", *map(str, args)]
        if log:
            self.repro.append("emapg " + " ".join(shlex.quote(str(a)) for a in args) + " &")
        return subprocess.Popen(cmd, cwd=self.dir, env=ENV, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, preexec_fn=_limits(AS_LIMIT, None))


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def has_tb(r: Result) -> bool:
    return "Traceback (most recent call last)" in r.text


def tb_last(r: Result) -> str:
    lines = [ln for ln in r.text.splitlines() if ln.strip()]
    idx = max(i for i, ln in enumerate(lines) if "Traceback (most recent call last)" in ln)
    after = [ln for ln in lines[idx:] if not ln.startswith(" ")]
    return after[-1] if after else lines[-1]


def err_line(r: Result) -> str:
    lines = [ln for ln in re.split(r"[\r\n]+", r.err) if ln.strip() and not re.search(r"\d+%\|", ln)]
    for key in ("error", "warning", "emapg"):
        hit = [ln for ln in lines if key in ln.lower()]
        if hit:
            return hit[-1][:500]
    return (lines[-1] if lines else "")[:500]


# ---------------------------------------------------------------------------------------------------------
# verdicts

def refused(r: Result, must=(), what="") -> tuple[str, str]:
    """Expect a one-line refusal whose text names each of ``must`` (case-insensitive)."""
    if r.timed_out:
        return HANG, f"no answer within {r.timeout} s (killed){': ' + what if what else ''}"
    if has_tb(r):
        return TB, f"Python traceback ({tb_last(r)})"
    if r.rc == 0:
        return WRONG, f"exit 0: accepted{' ' + what if what else ''}"
    missing = [m for m in must if str(m).lower() not in r.text.lower()]
    if missing:
        return UNCLEAR, f"the error does not name {missing}: {err_line(r)}"
    return HELD, f"refused (exit {r.rc}): {err_line(r)}"


def succeeded(r: Result, what="") -> tuple[str, str] | None:
    """None when it ran (exit 0, no traceback), else the verdict."""
    if r.timed_out:
        return HANG, f"no answer within {r.timeout} s (killed){': ' + what if what else ''}"
    if has_tb(r):
        return TB, f"Python traceback ({tb_last(r)})"
    if r.rc != 0:
        return UNCLEAR, f"expected it to run, exit {r.rc}: {err_line(r)}"
    return None


def digest(folder: Path, skip=(".emapg.lock",)) -> dict[str, str]:
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name not in skip:
            out[str(p.relative_to(folder))] = hashlib.sha256(p.read_bytes()).hexdigest()[:16]
    return out


def changed(before: dict, after: dict) -> list[str]:
    keys = set(before) | set(after)
    return sorted(k for k in keys if before.get(k) != after.get(k))


class FakeWriter:
    """This probe process holding a run folder's lock the way a live `emapg train` does (flock + its PID)."""

    def __init__(self, folder: Path, name=".emapg.lock"):
        folder.mkdir(parents=True, exist_ok=True)
        self.f = open(folder / name, "a+")
        fcntl.flock(self.f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.f.seek(0)
        self.f.truncate()
        self.f.write(f"{os.getpid()}\n")
        self.f.flush()

    def close(self):
        self.f.close()


# ---------------------------------------------------------------------------------------------------------
# fixtures

MATH_ROWS = [{"problem": "What is 1 + 1?", "answer": "2"}, {"problem": "What is 2 + 2?", "answer": "4"},
             {"problem": "What is 3 + 3?", "answer": "6"}]
QA_ROWS = [{"id": "q0", "question": "What is the capital of France?", "golden_answers": ["Paris"]},
           {"id": "q1", "question": "Where does the Danube flow?", "golden_answers": ["Black Sea"]},
           {"id": "q2", "question": "What is the highest mountain?", "golden_answers": ["Everest"]}]
CORPUS = [{"id": "0", "title": "Paris", "text": "Paris is the capital and largest city of France."},
          {"id": "1", "title": "Berlin", "text": "Berlin is the capital of Germany and its largest city."},
          {"id": "2", "title": "Danube", "text": "The Danube flows through ten countries into the Black Sea."},
          {"id": "3", "title": "Everest", "text": "Mount Everest is Earth's highest mountain above sea level."}]


def jsonl(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def build_fixtures(force: bool = False) -> None:
    FIX.mkdir(parents=True, exist_ok=True)
    (FIX / "math.jsonl").write_text(jsonl(MATH_ROWS))
    (FIX / "qa.jsonl").write_text(jsonl(QA_ROWS))
    (FIX / "corpus.jsonl").write_text(jsonl(CORPUS))
    ok = (FIX / "run" / "finished.json").exists() and (FIX / "run/checkpoints/step_000001/state.json").exists()
    if force or not ok:
        shutil.rmtree(FIX / "run", ignore_errors=True)
        r = subprocess.run([PY, "-m", "emapg", "train", "--config", "smoke", "--out", "run", *TINY,
                            "export=true", "keep_checkpoints=3"], cwd=FIX, env=ENV, capture_output=True,
                           timeout=600)
        if r.returncode != 0:
            raise SystemExit(f"fixture run failed:\n{r.stderr.decode()[-3000:]}")
    if force or not (FIX / "idx" / "emapg_index.json").exists():
        shutil.rmtree(FIX / "idx", ignore_errors=True)
        r = subprocess.run([PY, "-m", "emapg", "index", "build", "--corpus", "corpus.jsonl", "--out", "idx"],
                           cwd=FIX, env=ENV, capture_output=True, timeout=300)
        if r.returncode != 0:
            raise SystemExit(f"fixture index failed:\n{r.stderr.decode()[-3000:]}")


# ---------------------------------------------------------------------------------------------------------
# registry

CASES: list[tuple[str, str, str, object]] = []


def case(root: str, title: str):
    def deco(fn):
        CASES.append((fn.__name__, root, title, fn))
        return fn
    return deco


def math_cfg(c: Ctx, train="train.jsonl", eval_="eval.jsonl", extra="") -> str:
    """A math config over a tiny random model (1 step, 2 prompts x 2 samples, 4 tokens)."""
    text = (f"extends: smoke\ntask: math\ntask_args: {{train_file: {train}, eval_file: {eval_}, template: plain}}\n"
            "steps: 1\nprompts_per_step: 2\nmicro_batch_prompts: 1\nrollout: {n: 2, max_new_tokens: 4}\n"
            "eval: {every: 1, size: 2}\nsave_every: 0\nexport: false\n" + extra)
    c.write("math.yaml", text)
    return "math.yaml"


def eval_math(c: Ctx, data: str, *extra, timeout=DEFAULT_TIMEOUT) -> Result:
    return c.cli(["eval", "--model", "tiny-llama", "--task", "math", "--data", data, "--size", "3",
                  "--max-new-tokens", "2", *extra], timeout=timeout)


def eval_qa(c: Ctx, data: str, *extra) -> Result:
    return c.cli(["eval", "--model", "tiny-llama", "--task", "search_qa", "--task-args",
                  json.dumps({"index": str(FIX / "idx")}), "--data", data, "--size", "3", "--max-new-tokens", "2",
                  *extra])


# =========================================================================================================
# Root 1: a writer's children / other commands not covered by its run-folder lock

@case("1", "second `train --out RUN` while a live writer holds RUN's lock")
def r1_train_out_locked(c):
    run = c.copy_run()
    c.note(f"another process (PID {os.getpid()}) holds run/.emapg.lock with flock, as a live `emapg train` does")
    w = FakeWriter(run)
    try:
        before = digest(run)
        r = c.cli(["train", "--config", "smoke", "--out", "run", *TINY])
        if changed(before, digest(run)):
            return LOST, f"files changed under a live writer: {changed(before, digest(run))}"
        return refused(r, [str(os.getpid())])
    finally:
        w.close()


@case("1", "`train --resume RUN` while a live writer holds the lock")
def r1_resume_locked(c):
    run = c.copy_run()
    c.note(f"another process (PID {os.getpid()}) holds run/.emapg.lock")
    w = FakeWriter(run)
    try:
        before = digest(run)
        r = c.cli(["train", "--resume", "run", "steps=3"])
        if changed(before, digest(run)):
            return LOST, f"files changed under a live writer: {changed(before, digest(run))}"
        return refused(r, [str(os.getpid())])
    finally:
        w.close()


@case("1", "`train --nproc 2 --out RUN` while a live writer holds the lock (refused before torchrun starts)")
def r1_nproc2_locked(c):
    run = c.copy_run()
    c.note(f"another process (PID {os.getpid()}) holds run/.emapg.lock")
    w = FakeWriter(run)
    try:
        r = c.cli(["train", "--nproc", "2", "--config", "smoke", "--out", "run", *TINY])
        return refused(r, [str(os.getpid())])
    finally:
        w.close()


@case("1", "`train --nproc 2` whose batch does not split over 2 processes: refused before torchrun starts")
def r1_nproc2_bad_split(c):
    r = c.cli(["train", "--nproc", "2", "--config", "smoke", "--out", "r", *TINY, "prompts_per_step=3",
               "micro_batch_prompts=1"], timeout=180)
    v = refused(r, ["prompts_per_step"])
    if v[0] == HELD and "torch.distributed" in r.text and "ChildFailedError" in r.text:
        return UNCLEAR, "refused only after torchrun started (its failure report)"
    return v


@case("1", "`eval --out RUN` into a training run's folder")
def r1_eval_out_runfolder(c):
    run = c.copy_run()
    before = digest(run)
    r = c.cli(["eval", "--model", "tiny-llama", "--task", "arithmetic", "--size", "2", "--max-new-tokens", "2",
               "--out", "run"])
    if changed(before, digest(run)):
        return LOST, f"the run's files were overwritten: {changed(before, digest(run))}"
    return refused(r, ["run"])


@case("1", "`compare --out RUN` into a training run's folder")
def r1_compare_out_runfolder(c):
    run = c.copy_run()
    c.write("spec.yaml", f"base: {SMOKE}\nseeds: [0]\noverrides: [steps=1]\nconfigs: {{a: [algo.eta=1.0]}}\n")
    before = digest(run)
    r = c.cli(["compare", "--spec", "spec.yaml", "--out", "run"])
    if changed(before, digest(run)):
        return LOST, f"the run's files changed: {changed(before, digest(run))}"
    return refused(r, ["run"])


@case("1", "a second `compare` into an --out that a live compare holds")
def r1_compare_locked(c):
    c.write("spec.yaml", "base: " + str(SRC / "emapg/recipes/smoke.yaml") +
            "\nseeds: [0]\noverrides: [steps=1]\nconfigs: {a: [algo.eta=1.0]}\n")
    (c.dir / "out").mkdir()
    c.note(f"another process (PID {os.getpid()}) holds out/.compare.lock (flock), as a live compare does")
    w = FakeWriter(c.dir / "out", ".compare.lock")
    try:
        r = c.cli(["compare", "--spec", "spec.yaml", "--out", "out"])
        if (c.dir / "out" / "a").exists():
            return LOST, "it started runs in a folder a live compare holds"
        return refused(r, ["out", "compare"])
    finally:
        w.close()


@case("1", "`compare` when one of its run folders is being written by a live `emapg train` (no checkpoint yet)")
def r1_compare_live_child(c):
    c.write("spec.yaml", "base: " + str(SRC / "emapg/recipes/smoke.yaml") +
            "\nseeds: [0]\noverrides: [steps=1, eval.size=2, rollout.max_new_tokens=4, prompts_per_step=2, "
            "rollout.n=2, micro_batch_prompts=1, save_every=0, export=false]\nconfigs: {a: [algo.eta=1.0]}\n")
    live = c.dir / "out" / "a" / "seed0"
    live.mkdir(parents=True)
    (live / ".emapg-run").write_text("a run folder of emapg train\n")
    (live / "config.yaml").write_text("model: tiny-llama\n")
    (live / "metrics.jsonl").write_text('{"step": 0}\n')
    c.note("out/a/seed0 = a run folder (.emapg-run, config.yaml, metrics.jsonl) that a live `emapg train --out "
           f"out/a/seed0` (PID {os.getpid()}) is writing: it holds out/a/seed0/.emapg.lock")
    w = FakeWriter(live)
    try:
        before = digest(live)
        r = c.cli(["compare", "--spec", "spec.yaml", "--out", "out"], timeout=240)
        moved = (c.dir / "out/a/seed0.stale").exists()
        if moved or not live.exists() or changed(before, digest(live)):
            return LOST, ("compare renamed the live run's folder out/a/seed0 to out/a/seed0.stale (the live "
                          "writer's files moved under it)" if moved else
                          "the live run's files changed: "
                          f"{changed(before, digest(live)) if live.exists() else 'folder gone'}")
        return refused(r, [str(os.getpid())])
    finally:
        w.close()


@case("1", "`eval --data a/set.jsonl b/set.jsonl`: two sets with the same file name keep separate outputs")
def r1_eval_same_stem(c):
    c.write("a/set.jsonl", jsonl(MATH_ROWS[:2]))
    c.write("b/set.jsonl", jsonl(MATH_ROWS[1:]))
    r = c.cli(["eval", "--model", "tiny-llama", "--task", "math", "--data", "a/set.jsonl", "b/set.jsonl", "--size",
               "3", "--max-new-tokens", "2", "--out", "ev"])
    v = succeeded(r)
    if v:
        return v
    files = sorted(p.name for p in (c.dir / "ev").glob("*.samples.jsonl"))
    if len(files) != 2:
        return LOST, f"one samples file overwrote the other: {files}"
    return HELD, f"two sets, two files: {files}"


@case("1", "`eval --data x=a.jsonl x=b.jsonl`: two sets given the same NAME")
def r1_eval_same_name(c):
    c.write("a.jsonl", jsonl(MATH_ROWS[:2]))
    c.write("b.jsonl", jsonl(MATH_ROWS[1:]))
    r = c.cli(["eval", "--model", "tiny-llama", "--task", "math", "--data", "x=a.jsonl", "x=b.jsonl", "--size",
               "3", "--max-new-tokens", "2", "--out", "ev"])
    if r.rc != 0 and not has_tb(r) and not r.timed_out:
        return refused(r, ["x"])
    v = succeeded(r)
    if v:
        return v
    files = sorted(p.name for p in (c.dir / "ev").glob("*.samples.jsonl"))
    ev = json.loads((c.dir / "ev" / "eval.json").read_text())
    if len(files) != 2:
        return LOST, f"one set's samples overwrote the other's: {files}"
    return HELD, f"kept apart: {files}; eval.json keys {list(ev)[:4]}"


@case("1", "`eval --data nq=x.jsonl nq-2=y.jsonl z/nq.jsonl`: numbering collides with a given name")
def r1_eval_name_collision(c):
    for n in ("x", "y", "z/nq"):
        c.write(f"{n}.jsonl", jsonl(MATH_ROWS[:1]))
    r = c.cli(["eval", "--model", "tiny-llama", "--task", "math", "--data", "nq=x.jsonl", "nq-2=y.jsonl",
               "z/nq.jsonl", "--size", "1", "--max-new-tokens", "2", "--out", "ev"])
    v = succeeded(r)
    if v:
        return v
    files = sorted(p.name for p in (c.dir / "ev").glob("*.samples.jsonl"))
    return (HELD, f"3 files: {files}") if len(files) == 3 else (LOST, f"sets share a file: {files}")


@case("1", "`kb make --out DIR` where DIR holds the user's own train.jsonl")
def r1_kb_make_overwrites(c):
    c.write("mine/train.jsonl", '{"question": "my own hand-labelled data", "answers": ["x"]}\n')
    before = digest(c.dir / "mine")
    r = c.cli(["kb", "make", "--out", "mine"])
    after = digest(c.dir / "mine")
    if before["train.jsonl"] != after.get("train.jsonl"):
        return LOST, ("the user's mine/train.jsonl was overwritten without a word "
                      f"(exit {r.rc}; stderr: {tail_lines(r.err, 1)})")
    return (HELD, "refused or kept") if not has_tb(r) else (TB, tb_last(r))


@case("1", "`index build --out RUN` into a training run's folder")
def r1_index_into_run(c):
    run = c.copy_run()
    before = digest(run)
    r = c.cli(["index", "build", "--corpus", str(FIX / "corpus.jsonl"), "--out", "run"])
    if changed(before, digest(run)):
        return LOST, f"the run's files changed: {changed(before, digest(run))[:5]}"
    return refused(r, ["run"])


@case("1", "`export RUN --out DIR` where DIR/policy is a folder of the user's own files")
def r1_export_over_user_folder(c):
    c.copy_run()
    c.write("mine/policy/notes.txt", "my notes, not a model\n")
    r = c.cli(["export", "run", "--out", "mine"])
    if not (c.dir / "mine/policy/notes.txt").exists():
        return LOST, (f"exit {r.rc}: mine/policy (the user's folder, holding notes.txt) was replaced by the "
                      "export without a word")
    return (HELD, "kept the user's folder") if not has_tb(r) else (TB, tb_last(r))


@case("1", "`export RUN` while a live writer holds RUN's lock")
def r1_export_locked(c):
    run = c.copy_run()
    c.note(f"another process (PID {os.getpid()}) holds run/.emapg.lock")
    w = FakeWriter(run)
    try:
        r = c.cli(["export", "run"])
        if r.rc == 0 and not has_tb(r):
            return HELD, "exported into run/export-step_000002 (a folder the writer does not write)"
        return refused(r, [str(os.getpid())])
    finally:
        w.close()


@case("1", "`train --out RUN/checkpoints` (inside another run's folder)")
def r1_train_inside_run(c):
    run = c.copy_run()
    before = digest(run)
    r = c.cli(["train", "--config", "smoke", "--out", "run/checkpoints", *TINY])
    if changed(before, digest(run)):
        return LOST, f"the run's files changed: {changed(before, digest(run))[:5]}"
    return refused(r, ["run/checkpoints"])


@case("1", "`compare --out FILE` (a regular file)")
def r1_compare_out_file(c):
    c.write("spec.yaml", f"base: {SMOKE}\nseeds: [0]\nconfigs: {{a: [algo.eta=1.0]}}\n")
    c.write("out", "a file\n")
    r = c.cli(["compare", "--spec", "spec.yaml", "--out", "out"])
    return refused(r, ["out"])


# =========================================================================================================
# Root 2: a command that changes files before it knows it can run

def _resume_unchanged(c, run, args, must, expect_rc0=False):
    before = digest(run)
    r = c.cli(["train", "--resume", "run", *args])
    diff = changed(before, digest(run))
    if diff and r.rc != 0:
        return LOST, f"a resume that failed (exit {r.rc}) changed {diff[:6]}: {err_line(r)}"
    if expect_rc0:
        v = succeeded(r)
        if v:
            return v
        return (HELD, f"nothing changed: {err_line(r)}") if not diff else (WRONG, f"changed {diff[:6]}")
    return refused(r, must)


@case("2", "`--resume RUN --force model=/nonexistent steps=3`: fails; config.yaml and resumes.jsonl untouched")
def r2_resume_bad_model(c):
    run = c.copy_run()
    return _resume_unchanged(c, run, ["--force", "model=/nonexistent/model", "steps=3"], ["model", "/nonexistent"])


@case("2", "`--resume RUN seed=5` (changes the replay, no --force): refused, nothing written")
def r2_resume_unsafe(c):
    run = c.copy_run()
    return _resume_unchanged(c, run, ["seed=5", "steps=3"], ["seed", "--force"])


@case("2", "`--resume RUN steps=abc`: refused, nothing written")
def r2_resume_bad_value(c):
    run = c.copy_run()
    return _resume_unchanged(c, run, ["steps=abc"], ["steps"])


@case("2", "`--resume RUN steps=1` (before its checkpoint): refused, nothing written")
def r2_resume_before(c):
    run = c.copy_run()
    return _resume_unchanged(c, run, ["steps=1"], ["steps"])


@case("2", "`--resume RUN steps=2` of a finished run: says so, nothing written")
def r2_resume_noop(c):
    run = c.copy_run()
    return _resume_unchanged(c, run, ["steps=2"], [], expect_rc0=True)


@case("2", "`--resume RUN --force lr=abc steps=3`: a bad value with --force, nothing written")
def r2_resume_force_bad(c):
    run = c.copy_run()
    return _resume_unchanged(c, run, ["--force", "lr=abc", "steps=3"], ["lr"])


@case("2", "`--resume RUN --force task_args.digits=0 steps=3` (a value the task refuses)")
def r2_resume_force_taskargs(c):
    run = c.copy_run()
    return _resume_unchanged(c, run, ["--force", "task_args.digits=0", "steps=3"], ["digits"])


@case("2", "`latest` names a checkpoint of another run (../../other/checkpoints/step_000002)")
def r2_latest_elsewhere(c):
    c.copy_run()
    c.copy_run("other")
    c.write("run/checkpoints/latest", json.dumps({"checkpoint": "../../other/checkpoints/step_000002",
                                                  "step": 2}))
    other = digest(c.dir / "other")
    r = c.cli(["train", "--resume", "run", "steps=3"])
    if changed(other, digest(c.dir / "other")):
        return LOST, f"the other run's files changed: {changed(other, digest(c.dir / 'other'))[:5]}"
    if r.rc == 0 and not has_tb(r) and "latest" not in r.text:
        return WRONG, "resumed without a word about `latest` naming another run's checkpoint"
    if r.rc == 0 and not has_tb(r):
        return HELD, f"warned and resumed from its own checkpoint: {err_line(r)}"
    return refused(r, ["latest"])


@case("2", "`latest` holds an absolute path to another run's checkpoint")
def r2_latest_absolute(c):
    c.copy_run()
    c.copy_run("other")
    c.write("run/checkpoints/latest", json.dumps({"checkpoint": str(c.dir / "other/checkpoints/step_000002"),
                                                  "step": 2}))
    r = c.cli(["train", "--resume", "run", "steps=3"])
    if r.rc == 0 and not has_tb(r) and "latest" not in r.text:
        return WRONG, "resumed without a word about `latest` naming another run's checkpoint"
    if r.rc == 0 and not has_tb(r):
        return HELD, f"warned and resumed from its own checkpoint: {err_line(r)}"
    return refused(r, ["latest"])


@case("2", "a run stopped during its end's export (export/anchor missing, finished.json of an earlier step): "
           "resume finishes it")
def r2_resume_finish_export(c):
    run = c.copy_run()
    c.sh("rm -rf run/export/anchor && echo '{\"step\": 1}' > run/finished.json")
    r = c.cli(["train", "--resume", "run", "steps=2"])
    v = succeeded(r)
    if v:
        return v
    if not (run / "export/anchor/model.safetensors").exists():
        return WRONG, "exit 0 but export/anchor was not rewritten"
    return HELD, f"finished its end: {err_line(r)}"


@case("2", "SIGTERM a training run after its first checkpoint, then resume it")
def r2_sigterm_resume(c):
    c.note("start a 3-step run, send SIGTERM once checkpoints/step_000001 exists, then resume")
    p = c.popen(["train", "--config", "smoke", "--out", "run", *TINY, "steps=3", "export=true"])
    t0 = time.monotonic()
    while time.monotonic() - t0 < 120 and p.poll() is None:
        if (c.dir / "run/checkpoints/step_000001/state.json").exists():
            break
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    try:
        out, err = p.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        _killpg(p.pid)
        return HANG, "the run did not stop within 90 s of SIGTERM"
    err = err.decode("utf-8", "replace")
    c.outputs.append(f"[first run, exit {p.returncode}]\n{tail_lines(err, 6)}")
    if "Traceback" in err:
        return TB, "SIGTERM printed a traceback: " + tail_lines(err, 1)
    r = c.cli(["train", "--resume", "run", "steps=3"])
    v = succeeded(r)
    if v:
        return v
    if not (c.dir / "run/finished.json").exists():
        return WRONG, "resume exited 0 but the run did not finish"
    return HELD, f"stopped with exit {p.returncode} ({tail_lines(err, 1)}), resumed to the end"


@case("2", "`train --out RUN` where RUN stopped before its first checkpoint and also holds the user's notes.txt")
def r2_restart_keeps_user_file(c):
    c.write("run/.emapg-run", "a run folder of emapg train\n")
    c.write("run/config.yaml", "model: tiny-llama\n")
    c.write("run/notes.txt", "my notes\n")
    r = c.cli(["train", "--config", "smoke", "--out", "run", *TINY, "steps=1"])
    if not (c.dir / "run/notes.txt").exists():
        return LOST, "the user's run/notes.txt was deleted"
    v = succeeded(r)
    return v or (HELD, "restarted; notes.txt kept")


@case("2", "`eval --model /nonexistent --out newdir`: creates nothing before it knows it can run")
def r2_eval_out_created_early(c):
    r = c.cli(["eval", "--model", "/nonexistent/model", "--task", "arithmetic", "--size", "2", "--out", "newdir"])
    v = refused(r, ["/nonexistent/model"])
    if v[0] == HELD and (c.dir / "newdir").exists():
        return HELD, v[1] + " (note: left an empty folder newdir)"
    return v


@case("2", "`index build --out IDX` of an existing index from a corpus with a bad line 3: the old index kept")
def r2_index_rebuild_bad(c):
    c.sh(f"cp -r {FIX / 'idx'} idx")
    before = digest(c.dir / "idx")
    rows = [json.dumps(CORPUS[0]), json.dumps(CORPUS[1]), "{not json", json.dumps(CORPUS[3])]
    c.write("bad.jsonl", "\n".join(rows) + "\n")
    r = c.cli(["index", "build", "--corpus", "bad.jsonl", "--out", "idx"])
    if changed(before, digest(c.dir / "idx")):
        return LOST, f"the old index changed although the build failed: {changed(before, digest(c.dir / 'idx'))}"
    return refused(r, ["bad.jsonl", "line 3"])


@case("2", "`export RUN --out EXP` again after the checkpoint was damaged: the earlier export kept")
def r2_export_again_damaged(c):
    c.copy_run()
    r0 = c.cli(["export", "run", "--out", "exp"])
    if r0.rc != 0:
        return succeeded(r0) or (UNCLEAR, "first export failed")
    before = digest(c.dir / "exp")
    c.sh("for s in 1 2; do head -c 1000 run/checkpoints/step_00000$s/policy.safetensors > t && "
         "mv t run/checkpoints/step_00000$s/policy.safetensors; done")
    r = c.cli(["export", "run", "--out", "exp"])
    if changed(before, digest(c.dir / "exp")):
        return LOST, f"the earlier export changed: {changed(before, digest(c.dir / 'exp'))[:4]}"
    return refused(r, ["policy.safetensors"])


@case("2", "`train --out FILE` (an existing regular file)")
def r2_train_out_file(c):
    c.write("out", "my file\n")
    r = c.cli(["train", "--config", "smoke", "--out", "out", *TINY])
    if (c.dir / "out").read_text() != "my file\n":
        return LOST, "the file was changed"
    return refused(r, ["out"])


@case("2", "`compare` with a spec that fails to load creates no --out folder")
def r2_compare_bad_spec_no_out(c):
    c.write("spec.yaml", f"base: {SMOKE}\nseeds: [0]\nconfigs: {{a: [algo.eta=7]}}\n")
    r = c.cli(["compare", "--spec", "spec.yaml", "--out", "out"])
    v = refused(r, ["algo.eta"])
    if v[0] == HELD and (c.dir / "out").exists():
        return WRONG, "refused, but it created out/ first"
    return v


@case("2", "`train --resume RUN` whose config.yaml was hand-edited to an invalid value: nothing written")
def r2_resume_bad_config_edit(c):
    run = c.copy_run()
    c.sh("sed -i 's/^lr: .*/lr: -1/' run/config.yaml")
    before = digest(run)
    r = c.cli(["train", "--resume", "run", "steps=3"])
    if changed(before, digest(run)):
        return LOST, f"changed {changed(before, digest(run))[:5]}"
    return refused(r, ["config.yaml", "lr"])


# =========================================================================================================
# Root 3: files read back trusted by shape

def _damaged_resume(c, rel: str, content, name: str | None = None, args=("steps=3",)):
    """Damage run/REL, resume: a one-line error naming it, or a resume from the other checkpoint that says so."""
    c.copy_run()
    if content is None:
        c.sh(f"rm -rf run/{rel}")
    elif content == "DIR":
        c.sh(f"rm -rf run/{rel} && mkdir run/{rel}")
    else:
        c.write(f"run/{rel}", content)
    name = name or Path(rel).name
    r = c.cli(["train", "--resume", "run", *args])
    if r.timed_out or has_tb(r):
        return refused(r)
    if r.rc == 0:
        if name.lower() not in r.text.lower():
            return WRONG, f"resumed without naming the damaged {rel}"
        return HELD, f"named it and resumed from an intact checkpoint: {err_line(r)}"
    return refused(r, [name])


def _half(path: Path) -> bytes:
    b = path.read_bytes()
    return b[: len(b) // 2]


@case("3", "checkpoint state.json is a JSON list")
def r3_state_list(c):
    return _damaged_resume(c, "checkpoints/step_000002/state.json", "[]")


@case("3", "checkpoint state.json is `null`")
def r3_state_null(c):
    return _damaged_resume(c, "checkpoints/step_000002/state.json", "null")


@case("3", "checkpoint state.json cut in half")
def r3_state_truncated(c):
    return _damaged_resume(c, "checkpoints/step_000002/state.json",
                           _half(FIX / "run/checkpoints/step_000002/state.json"))


@case("3", "checkpoint state.json with step \"2\" (a string)")
def r3_state_step_string(c):
    s = json.loads((FIX / "run/checkpoints/step_000002/state.json").read_text())
    s["step"] = "2"
    return _damaged_resume(c, "checkpoints/step_000002/state.json", json.dumps(s))


@case("3", "checkpoint state.json with optimizer: null")
def r3_state_opt_null(c):
    s = json.loads((FIX / "run/checkpoints/step_000002/state.json").read_text())
    s["optimizer"] = None
    return _damaged_resume(c, "checkpoints/step_000002/state.json", json.dumps(s))


@case("3", "checkpoint state.json with optimizer.param_groups a string")
def r3_state_groups_string(c):
    s = json.loads((FIX / "run/checkpoints/step_000002/state.json").read_text())
    s["optimizer"]["param_groups"] = "x"
    return _damaged_resume(c, "checkpoints/step_000002/state.json", json.dumps(s))


@case("3", "checkpoint state.json with initial_eval a list and skipped_steps null")
def r3_state_fields_odd(c):
    s = json.loads((FIX / "run/checkpoints/step_000002/state.json").read_text())
    s["initial_eval"] = [1, 2]
    s["skipped_steps"] = None
    return _damaged_resume(c, "checkpoints/step_000002/state.json", json.dumps(s))


@case("3", "checkpoint state.json is not UTF-8")
def r3_state_binary(c):
    return _damaged_resume(c, "checkpoints/step_000002/state.json", b"\xff\xfe\x00garbage")


@case("3", "checkpoints/latest is a JSON list")
def r3_latest_list(c):
    return _damaged_resume(c, "checkpoints/latest", "[1, 2]")


@case("3", "checkpoints/latest is empty")
def r3_latest_empty(c):
    return _damaged_resume(c, "checkpoints/latest", "")


@case("3", "checkpoints/latest names checkpoint 5 (a number)")
def r3_latest_number(c):
    return _damaged_resume(c, "checkpoints/latest", json.dumps({"checkpoint": 5, "step": 2}))


@case("3", "checkpoints/latest with checkpoint: null")
def r3_latest_null(c):
    return _damaged_resume(c, "checkpoints/latest", json.dumps({"checkpoint": None}))


@case("3", "checkpoints/latest is not UTF-8")
def r3_latest_binary(c):
    return _damaged_resume(c, "checkpoints/latest", b"\xff\xfe\x80\x81")


@case("3", "checkpoints/latest is a directory")
def r3_latest_dir(c):
    return _damaged_resume(c, "checkpoints/latest", "DIR")


@case("3", "checkpoints/latest names a missing step_000009")
def r3_latest_missing(c):
    return _damaged_resume(c, "checkpoints/latest", json.dumps({"checkpoint": "step_000009", "step": 9}))


@case("3", "policy.safetensors of the newest checkpoint cut to 1000 bytes")
def r3_policy_truncated(c):
    return _damaged_resume(c, "checkpoints/step_000002/policy.safetensors",
                           (FIX / "run/checkpoints/step_000002/policy.safetensors").read_bytes()[:1000])


@case("3", "optimizer.safetensors of the newest checkpoint is text")
def r3_optimizer_garbage(c):
    return _damaged_resume(c, "checkpoints/step_000002/optimizer.safetensors", "not a safetensors file\n")


@case("3", "anchor.safetensors of the newest checkpoint is empty")
def r3_anchor_empty(c):
    return _damaged_resume(c, "checkpoints/step_000002/anchor.safetensors", b"")


@case("3", "a backup folder step_000002.bak and a bare step_000007/ beside the checkpoints are ignored")
def r3_backup_folders(c):
    c.copy_run()
    c.sh("cp -r run/checkpoints/step_000002 run/checkpoints/step_000002.bak && "
         "echo garbage > run/checkpoints/step_000002.bak/state.json && mkdir run/checkpoints/step_000007 && "
         "cp -r run/checkpoints/step_000001 run/checkpoints/step_000003.old")
    r = c.cli(["train", "--resume", "run", "steps=3"])
    v = succeeded(r)
    if v:
        return v
    m = [json.loads(x) for x in (c.dir / "run/metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [x["step"] for x in m if "reward_mean" in x]
    return (HELD, f"resumed from step 2: train steps {steps}") if steps == [1, 2, 3] else \
        (WRONG, f"train steps logged {steps}")


@case("3", "metrics.jsonl's last line cut short (a kill mid-write): resume warns and goes on")
def r3_metrics_cut(c):
    c.copy_run()
    text = (FIX / "run/metrics.jsonl").read_text()
    c.write("run/metrics.jsonl", text + '{"step": 3, "reward_me')
    r = c.cli(["train", "--resume", "run", "steps=3"])
    v = succeeded(r)
    if v:
        return v
    bad = [ln for ln in (c.dir / "run/metrics.jsonl").read_text().splitlines() if ln.strip() and
           not ln.strip().endswith("}")]
    return (WRONG, f"metrics.jsonl keeps a broken line: {bad[:1]}") if bad else (HELD, err_line(r))


@case("3", "metrics.jsonl with a garbage line in the middle")
def r3_metrics_middle(c):
    c.copy_run()
    lines = (FIX / "run/metrics.jsonl").read_text().splitlines()
    lines.insert(1, "{garbage")
    c.write("run/metrics.jsonl", "\n".join(lines) + "\n")
    r = c.cli(["train", "--resume", "run", "steps=3"])
    return refused(r, ["metrics.jsonl", "line 2"]) if r.rc != 0 or has_tb(r) else (HELD, "resumed: " + err_line(r))


@case("3", "metrics.jsonl with a line that is a JSON list")
def r3_metrics_list_line(c):
    c.copy_run()
    c.write("run/metrics.jsonl", (FIX / "run/metrics.jsonl").read_text() + "[1, 2]\n")
    r = c.cli(["train", "--resume", "run", "steps=3"])
    return refused(r, ["metrics.jsonl"]) if r.rc != 0 or has_tb(r) else (HELD, "resumed: " + err_line(r))


@case("3", "metrics.jsonl with {\"step\": true}")
def r3_metrics_step_bool(c):
    c.copy_run()
    c.write("run/metrics.jsonl", (FIX / "run/metrics.jsonl").read_text() + '{"step": true}\n')
    r = c.cli(["train", "--resume", "run", "steps=3"])
    return refused(r, ["metrics.jsonl"]) if r.rc != 0 or has_tb(r) else (HELD, "resumed: " + err_line(r))


@case("3", "a run's config.yaml is not UTF-8 (resume)")
def r3_config_binary(c):
    c.copy_run()
    with open(c.dir / "run/config.yaml", "ab") as f:
        f.write(b"# caf\xe9\n")
    c.repro.append("printf '# caf\\351\\n' >> run/config.yaml   # a Latin-1 byte 0xe9 on the last line")
    r = c.cli(["train", "--resume", "run", "steps=3"])
    return refused(r, ["config.yaml", "UTF-8"])


@case("3", "a run's config.yaml is a YAML list (resume)")
def r3_config_list(c):
    c.copy_run()
    c.write("run/config.yaml", "- a\n- b\n")
    r = c.cli(["train", "--resume", "run", "steps=3"])
    return refused(r, ["config.yaml"])


@case("3", "finished.json holds garbage (resume to the same step finishes the run's end again)")
def r3_finished_garbage(c):
    c.copy_run()
    c.write("run/finished.json", "\xff garbage [")
    r = c.cli(["train", "--resume", "run", "steps=2"])
    return succeeded(r) or (HELD, err_line(r))


@case("3", "`eval --run RUN` whose config.yaml sets task_args to a list")
def r3_eval_run_taskargs_list(c):
    c.copy_run()
    c.sh("sed -i '/^task_args:/,/^steps:/c\\task_args: [1, 2]\\nsteps: 2' run/config.yaml")
    r = c.cli(["eval", "--run", "run", "--size", "2", "--max-new-tokens", "2"])
    return refused(r, ["task_args"])


@case("3", "`eval --run RUN` whose export/policy/config.json is not JSON")
def r3_eval_run_bad_export(c):
    c.copy_run()
    c.write("run/export/policy/config.json", "{not json")
    r = c.cli(["eval", "--run", "run", "--size", "2", "--max-new-tokens", "2"])
    return refused(r, ["config.json"])


@case("3", "`export RUN` whose config.yaml names a model other than the checkpoint's (tiny-qwen2)")
def r3_export_other_model(c):
    c.copy_run()
    c.sh("sed -i 's/^model: .*/model: tiny-qwen2/' run/config.yaml")
    r = c.cli(["export", "run"])
    return refused(r, ["policy.safetensors"])


# ---- compare: spec fields and the run files its report reads

def _spec(c, body: str, name="spec.yaml"):
    c.write(name, body)
    return name


def _fake_compare_out(c, mutate=None):
    """out/a/seed0 = a copy of the finished fixture run (its eval.json, metrics.jsonl, outcomes)."""
    dst = c.dir / "out/a/seed0"
    dst.parent.mkdir(parents=True)
    shutil.copytree(FIX / "run", dst)
    shutil.rmtree(dst / "checkpoints")
    c.repro.append(f"mkdir -p out/a && cp -r {FIX / 'run'} out/a/seed0 && rm -rf out/a/seed0/checkpoints")
    if mutate:
        mutate(dst)


SPEC_OK = "seeds: [0]\noverrides: [steps=2]\nconfigs: {a: [algo.eta=1.0]}\n"


@case("3", "`compare --report-only` when a run's eval.json is a JSON list")
def r3_compare_evaljson_list(c):
    _spec(c, f"base: {SMOKE}\n" + SPEC_OK)
    _fake_compare_out(c)
    c.write("out/a/seed0/eval.json", "[1, 2]")
    r = c.cli(["compare", "--spec", "spec.yaml", "--out", "out", "--report-only"])
    return refused(r, ["eval.json"])


@case("3", "`compare --report-only` when a run's eval.json lacks 'policy'")
def r3_compare_evaljson_nopolicy(c):
    _spec(c, f"base: {SMOKE}\n" + SPEC_OK)
    _fake_compare_out(c)
    c.write("out/a/seed0/eval.json", json.dumps({"init": {"accuracy": 0.5}}))
    r = c.cli(["compare", "--spec", "spec.yaml", "--out", "out", "--report-only"])
    return refused(r, ["eval.json"])


@case("3", "`compare --report-only` when a run's eval.json is cut short")
def r3_compare_evaljson_cut(c):
    _spec(c, f"base: {SMOKE}\n" + SPEC_OK)
    _fake_compare_out(c)
    c.write("out/a/seed0/eval.json", '{"init": {"accura')
    r = c.cli(["compare", "--spec", "spec.yaml", "--out", "out", "--report-only"])
    return refused(r, ["eval.json"])


@case("3", "`compare --report-only` when a run's metrics.jsonl is empty")
def r3_compare_metrics_empty(c):
    _spec(c, f"base: {SMOKE}\n" + SPEC_OK)
    _fake_compare_out(c)
    c.write("out/a/seed0/metrics.jsonl", "")
    r = c.cli(["compare", "--spec", "spec.yaml", "--out", "out", "--report-only"])
    return refused(r, ["metrics.jsonl"]) if (r.rc != 0 or has_tb(r)) else (HELD, "reported without it")


@case("3", "`compare --report-only` when a run's compute.json is garbage")
def r3_compare_compute_garbage(c):
    _spec(c, f"base: {SMOKE}\n" + SPEC_OK)
    _fake_compare_out(c)
    c.write("out/a/seed0/compute.json", "{garbage")
    r = c.cli(["compare", "--spec", "spec.yaml", "--out", "out", "--report-only"])
    return refused(r, ["compute.json"]) if (r.rc != 0 or has_tb(r)) else (HELD, "reported without it")


@case("3", "`compare --report-only` when a run's outcomes/outcomes.jsonl is garbage")
def r3_compare_outcomes_garbage(c):
    _spec(c, f"base: {SMOKE}\nseeds: [0]\noverrides: [steps=2]\nconfigs: {{a: [algo.eta=1.0], b: [algo.eta=0.9]}}\n")
    _fake_compare_out(c)
    c.sh("mkdir -p out/b && cp -r out/a/seed0 out/b/seed0")
    c.write("out/a/seed0/outcomes/outcomes.jsonl", "{garbage\n[1]\n")
    r = c.cli(["compare", "--spec", "spec.yaml", "--out", "out", "--report-only"])
    return refused(r, ["outcomes"]) if (r.rc != 0 or has_tb(r)) else (HELD, "reported: " + err_line(r))


@case("3", "compare spec `base: 5` (a number)")
def r3_spec_base_int(c):
    _spec(c, "base: 5\n" + SPEC_OK)
    return refused(c.cli(["compare", "--spec", "spec.yaml", "--out", "out"]), ["base"])


@case("3", "compare spec `base: null`")
def r3_spec_base_null(c):
    _spec(c, "base: null\n" + SPEC_OK)
    return refused(c.cli(["compare", "--spec", "spec.yaml", "--out", "out"]), ["base"])


@case("3", "compare spec `quick: {only: 5}` with --quick")
def r3_spec_quick_only_int(c):
    _spec(c, f"base: {SMOKE}\n" + SPEC_OK + "quick: {only: 5}\n")
    return refused(c.cli(["compare", "--spec", "spec.yaml", "--out", "out", "--quick"]), ["only"])


@case("3", "compare spec `quick: {seeds: 0}` (not a list) with --quick")
def r3_spec_quick_seeds_int(c):
    _spec(c, f"base: {SMOKE}\n" + SPEC_OK + "quick: {seeds: 0}\n")
    return refused(c.cli(["compare", "--spec", "spec.yaml", "--out", "out", "--quick"]), ["seeds"])


@case("3", "compare spec `overrides: steps=1` (a string, not a list)")
def r3_spec_overrides_string(c):
    _spec(c, f"base: {SMOKE}\nseeds: [0]\noverrides: steps=1\nconfigs: {{a: [algo.eta=1.0]}}\n")
    return refused(c.cli(["compare", "--spec", "spec.yaml", "--out", "out"]), ["overrides"])


@case("3", "compare spec `configs: [a, b]` (a list)")
def r3_spec_configs_list(c):
    _spec(c, f"base: {SMOKE}\nseeds: [0]\nconfigs: [a, b]\n")
    return refused(c.cli(["compare", "--spec", "spec.yaml", "--out", "out"]), ["configs"])


@case("3", "compare spec `configs: {a: {label: [1, 2], overrides: [steps=1]}}` (a list label)")
def r3_spec_label_list(c):
    _spec(c, f"base: {SMOKE}\nseeds: [0]\nconfigs: {{a: {{label: [1, 2], overrides: [steps=2]}}}}\n")
    _fake_compare_out(c)
    r = c.cli(["compare", "--spec", "spec.yaml", "--out", "out", "--report-only"])
    return refused(r, ["label"]) if (r.rc != 0 or has_tb(r)) else (HELD, "reported (label shown as text)")


@case("3", "compare spec `groups: {g: a}` (a string, not a list)")
def r3_spec_groups_string(c):
    _spec(c, f"base: {SMOKE}\n" + SPEC_OK + "groups: {g: a}\n")
    return refused(c.cli(["compare", "--spec", "spec.yaml", "--out", "out"]), ["groups"])


@case("3", "compare spec `prune_checkpoints: yes please`")
def r3_spec_prune_string(c):
    _spec(c, f"base: {SMOKE}\n" + SPEC_OK + "prune_checkpoints: yes please\n")
    return refused(c.cli(["compare", "--spec", "spec.yaml", "--out", "out"]), ["prune_checkpoints"])


@case("3", "compare spec `seeds: [0, true]`")
def r3_spec_seed_bool(c):
    _spec(c, f"base: {SMOKE}\nseeds: [0, true]\nconfigs: {{a: [algo.eta=1.0]}}\n")
    return refused(c.cli(["compare", "--spec", "spec.yaml", "--out", "out"]), ["seeds"])


@case("3", "compare spec `configs: {a: [5]}` (an override that is a number)")
def r3_spec_override_int(c):
    _spec(c, f"base: {SMOKE}\nseeds: [0]\nconfigs: {{a: [5]}}\n")
    return refused(c.cli(["compare", "--spec", "spec.yaml", "--out", "out"]), ["configs.a"])


@case("3", "compare spec is an empty file")
def r3_spec_empty(c):
    _spec(c, "")
    return refused(c.cli(["compare", "--spec", "spec.yaml", "--out", "out"]), ["spec.yaml"])


@case("3", "compare spec is not UTF-8")
def r3_spec_binary(c):
    c.write("spec.yaml", f"base: {SMOKE}\n".encode() + b"# \xff\xfe\n" + SPEC_OK.encode())
    return refused(c.cli(["compare", "--spec", "spec.yaml", "--out", "out"]), ["spec.yaml"])


@case("3", "compare spec `hypotheses: 5` (a spec that states hypotheses of the wrong shape)")
def r3_spec_hypotheses_int(c):
    _spec(c, f"base: {SMOKE}\n" + SPEC_OK + "hypotheses: 5\n")
    _fake_compare_out(c)
    r = c.cli(["compare", "--spec", "spec.yaml", "--out", "out", "--report-only"])
    return refused(r, ["hypotheses"]) if (r.rc != 0 or has_tb(r)) else (HELD, "reported: " + err_line(r))


# ---- data rows: gold answers of odd types, null fields

def _math_eval_rows(c, rows, must, raw=None):
    c.write("d.jsonl", raw if raw is not None else jsonl(rows))
    return refused(eval_math(c, "d.jsonl"), must)


@case("3", "math data: answer true (a boolean)")
def r3_gold_bool(c):
    return _math_eval_rows(c, [{"problem": "p", "answer": True}], ["d.jsonl", "line 1", "answer"])


@case("3", "math data: answer [] (an empty list)")
def r3_gold_empty_list(c):
    return _math_eval_rows(c, [{"problem": "p", "answer": []}], ["d.jsonl", "line 1", "answer"])


@case("3", "math data: answer {\"a\": 1} (an object)")
def r3_gold_dict(c):
    return _math_eval_rows(c, [{"problem": "p", "answer": {"a": 1}}], ["d.jsonl", "line 1", "answer"])


@case("3", "math data: answer [[1, 2]] (a nested list)")
def r3_gold_nested(c):
    return _math_eval_rows(c, [{"problem": "p", "answer": [[1, 2]]}], ["d.jsonl", "line 1", "answer"])


@case("3", "math data: answer NaN (JSON's non-standard NaN)")
def r3_gold_nan(c):
    return _math_eval_rows(c, None, ["d.jsonl", "line 1", "answer"], raw='{"problem": "p", "answer": NaN}\n')


@case("3", "math data: answer 1e999 (parses to infinity)")
def r3_gold_inf(c):
    return _math_eval_rows(c, None, ["d.jsonl", "line 1", "answer"], raw='{"problem": "p", "answer": 1e999}\n')


@case("3", "math data: problem null")
def r3_problem_null(c):
    return _math_eval_rows(c, [{"problem": None, "answer": "1"}], ["d.jsonl", "line 1", "problem"])


@case("3", "math data: problem 5 (a number)")
def r3_problem_int(c):
    return _math_eval_rows(c, [{"problem": 5, "answer": "1"}], ["d.jsonl", "line 1", "problem"])


@case("3", "math data: rows with the same id in a training run's eval_file (outcomes keyed by id)")
def r3_duplicate_ids(c):
    rows = [{"id": "x", "problem": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(1, 4)]
    c.write("train.jsonl", jsonl(MATH_ROWS))
    c.write("eval.jsonl", jsonl(rows))
    cfg = math_cfg(c)  # (its eval: block given twice is refused since YAML keys are checked: an override)
    r = c.cli(["train", "--config", cfg, "--out", "run", "eval.size=3"])
    if r.rc != 0 or has_tb(r) or r.timed_out:
        return refused(r, ["eval.jsonl", "id"])
    md = (c.dir / "run/eval.md").read_text()
    m = re.search(r"on the same (\d+) heldout problems", md)
    n = int(m.group(1)) if m else None
    if n is not None and n != 3:
        return WRONG, f"3 held-out rows with one id: eval.md pairs 'the same {n} heldout problems' (not 3)"
    return HELD, f"eval.md: {md.strip().splitlines()[-1][:200]}"


@case("3", "search data (Search-R1 layout) with prompt[0].content a number")
def r3_sr1_content_int(c):
    c.write("d.jsonl", jsonl([{"id": "0", "prompt": [{"role": "user", "content": 5}],
                               "reward_model": {"ground_truth": {"target": ["Paris"]}}}]))
    return refused(eval_qa(c, "d.jsonl"), ["d.jsonl", "line 1"])


@case("3", "search data (Search-R1 layout) with extra_info a list")
def r3_sr1_extra_info_list(c):
    c.write("d.jsonl", jsonl([{"id": "0", "prompt": [{"role": "user", "content": "Question: where?"}],
                               "reward_model": {"ground_truth": {"target": ["Paris"]}}, "extra_info": [1]}]))
    return refused(eval_qa(c, "d.jsonl"), ["d.jsonl", "line 1"])


@case("3", "search data (Search-R1 layout) with target \"Paris\" (a string, not a list)")
def r3_sr1_target_string(c):
    c.write("d.jsonl", jsonl([{"id": "0", "prompt": [{"role": "user", "content": "Question: capital of France?"}],
                               "reward_model": {"ground_truth": {"target": "Paris"}}}]))
    r = eval_qa(c, "d.jsonl")
    if r.rc != 0 or has_tb(r) or r.timed_out:
        return refused(r, ["target"])
    p = c.py("""
        from emapg.tasks.search_qa import qa_rows
        from emapg.rewards.qa import qa_em
        rows = qa_rows("d.jsonl")
        print("gold answers:", rows[0]["answers"], "| score of the answer 's':", qa_em("s", rows[0]["answers"]),
              "| score of 'Paris':", qa_em("Paris", rows[0]["answers"]))
    """)
    out = p.out.strip()
    if "['P'" in out or "'p'" in out.lower() and "'r'" in out:
        return WRONG, f"accepted (exit 0); the string was split into letters: {out}"
    return HELD, out


@case("3", "search data: golden_answers null")
def r3_qa_gold_null(c):
    c.write("d.jsonl", jsonl([{"id": "0", "question": "q?", "golden_answers": None}]))
    return refused(eval_qa(c, "d.jsonl"), ["d.jsonl", "line 1"])


@case("3", "search data: question null")
def r3_qa_question_null(c):
    c.write("d.jsonl", jsonl([{"id": "0", "question": None, "golden_answers": ["x"]}]))
    return refused(eval_qa(c, "d.jsonl"), ["d.jsonl", "line 1", "question"])


@case("3", "search data: golden_answers {\"a\": \"Paris\"} (an object)")
def r3_qa_gold_dict(c):
    c.write("d.jsonl", jsonl([{"id": "0", "question": "q?", "golden_answers": {"a": "Paris"}}]))
    return refused(eval_qa(c, "d.jsonl"), ["d.jsonl", "line 1", "golden_answers"])


@case("3", "index folder whose emapg_index.json is a JSON list (serve-retriever)")
def r3_index_meta_list(c):
    c.sh(f"cp -r {FIX / 'idx'} idx")
    c.write("idx/emapg_index.json", "[1]")
    return serve_refused(c, ["--index", "idx", "--port", "0"], ["emapg_index.json"])


@case("3", "index folder whose emapg_index.json says documents: 99 (serve-retriever)")
def r3_index_meta_count(c):
    c.sh(f"cp -r {FIX / 'idx'} idx")
    meta = json.loads((FIX / "idx/emapg_index.json").read_text())
    meta["documents"] = 99
    c.write("idx/emapg_index.json", json.dumps(meta))
    v = serve_refused(c, ["--index", "idx", "--port", "0"], ["emapg_index.json"])
    if v[0] == WRONG and "serving 4 documents" in v[1]:
        return HELD, "served the index's real 4 passages (the stated count is not trusted)"
    return v


@case("3", "index folder whose passages file is cut short (serve-retriever)")
def r3_index_passages_cut(c):
    c.sh(f"cp -r {FIX / 'idx'} idx")
    files = [p for p in (c.dir / "idx").iterdir() if p.name.startswith("passages")]
    if not files:
        return PROBE_ERR, "no passages file in the index"
    f = files[0]
    c.write(f"idx/{f.name}", f.read_bytes()[: f.stat().st_size // 2])
    return serve_refused(c, ["--index", "idx", "--port", "0"], [f.name])


def serve_refused(c, args, must, timeout=45):
    r = c.cli(["serve-retriever", *args], timeout=timeout)
    if r.timed_out and "serving" in r.err:
        return WRONG, f"it started serving: {err_line(r)}"
    return refused(r, must)


# =========================================================================================================
# Root 4: data rows with bad text (lone surrogates, non-UTF-8)

SUR = "\\ud83d"  # written into JSON as the escape: a lone surrogate once parsed


@case("4", "math train_file: a problem with a lone surrogate (training run)")
def r4_math_train_surrogate(c):
    c.write("train.jsonl", jsonl(MATH_ROWS[:2]) + '{"problem": "bad \\ud83d row", "answer": "1"}\n')
    c.write("eval.jsonl", jsonl(MATH_ROWS))
    r = c.cli(["train", "--config", math_cfg(c), "--out", "run"])
    return refused(r, ["train.jsonl", "line 3"])


@case("4", "math eval --data: an answer with a lone surrogate")
def r4_math_answer_surrogate(c):
    c.write("d.jsonl", '{"problem": "p", "answer": "1\\ud83d"}\n')
    return refused(eval_math(c, "d.jsonl"), ["d.jsonl", "line 1"])


@case("4", "math eval --data (.json list): a problem with a lone surrogate")
def r4_math_json_surrogate(c):
    c.write("d.json", '[{"problem": "p \\ud83d", "answer": "1"}]')
    return refused(eval_math(c, "d.json"), ["d.json", "item 0"])


@case("4", "math data: a lone surrogate in a column the task maps (problem_field=question)")
def r4_math_mapped_surrogate(c):
    c.write("d.jsonl", '{"question": "q \\ud83d", "answer": "1"}\n')
    r = c.cli(["eval", "--model", "tiny-llama", "--task", "math", "--task-args", '{"problem_field": "question"}',
               "--data", "d.jsonl", "--size", "2", "--max-new-tokens", "2"])
    return refused(r, ["d.jsonl", "line 1"])


@case("4", "math eval --data --out: a lone surrogate in the row's id (written to SET.samples.jsonl)")
def r4_math_id_surrogate(c):
    c.write("d.jsonl", '{"id": "a\\ud83d", "problem": "What is 1 + 1?", "answer": "2"}\n')
    r = eval_math(c, "d.jsonl", "--out", "ev")
    if r.rc == 0 and not has_tb(r):
        return HELD, "ran and wrote its files"
    return refused(r, ["d.jsonl", "line 1"])


@case("4", "search data: data_source with a lone surrogate (it names the set)")
def r4_qa_source_surrogate(c):
    c.write("d.jsonl", '{"id": "0", "question": "capital of France?", "golden_answers": ["Paris"], '
                       '"data_source": "nq\\ud83d"}\n')
    r = eval_qa(c, "d.jsonl", "--out", "ev")
    if r.rc == 0 and not has_tb(r):
        return HELD, "ran"
    return refused(r, ["d.jsonl", "line 1"])


@case("4", "search data: a question with a lone surrogate")
def r4_qa_question_surrogate(c):
    c.write("d.jsonl", '{"id": "0", "question": "where \\ud83d?", "golden_answers": ["Paris"]}\n')
    return refused(eval_qa(c, "d.jsonl"), ["d.jsonl", "line 1"])


@case("4", "search data: golden_answers with a lone surrogate")
def r4_qa_gold_surrogate(c):
    c.write("d.jsonl", '{"id": "0", "question": "where?", "golden_answers": ["Par\\ud83dis"]}\n')
    return refused(eval_qa(c, "d.jsonl"), ["d.jsonl", "line 1"])


@case("4", "search data (Search-R1 layout): the prompt's question with a lone surrogate")
def r4_sr1_surrogate(c):
    c.write("d.jsonl", '{"id": "0", "prompt": [{"role": "user", "content": "Question: where \\ud83d?"}], '
                       '"reward_model": {"ground_truth": {"target": ["Paris"]}}}\n')
    return refused(eval_qa(c, "d.jsonl"), ["d.jsonl", "line 1"])


@case("4", "index corpus: a passage text with a lone surrogate")
def r4_corpus_text_surrogate(c):
    c.write("c.jsonl", jsonl(CORPUS[:2]) + '{"id": "9", "title": "T", "text": "bad \\ud83d text"}\n')
    return refused(c.cli(["index", "build", "--corpus", "c.jsonl", "--out", "idx"]), ["c.jsonl", "line 3"])


@case("4", "index corpus: a title with a lone surrogate")
def r4_corpus_title_surrogate(c):
    c.write("c.jsonl", '{"id": "9", "title": "T\\ud83d", "text": "text"}\n' + jsonl(CORPUS[:2]))
    return refused(c.cli(["index", "build", "--corpus", "c.jsonl", "--out", "idx"]), ["c.jsonl", "line 1"])


@case("4", "index corpus: an id with a lone surrogate")
def r4_corpus_id_surrogate(c):
    c.write("c.jsonl", '{"id": "9\\ud83d", "title": "T", "text": "text"}\n' + jsonl(CORPUS[:2]))
    return refused(c.cli(["index", "build", "--corpus", "c.jsonl", "--out", "idx"]), ["c.jsonl", "line 1"])


@case("4", "index corpus ({id, contents} layout) with a lone surrogate in contents")
def r4_corpus_contents_surrogate(c):
    c.write("c.jsonl", '{"id": "0", "contents": "\\"T\\"\\nfine"}\n{"id": "1", "contents": "\\"U\\"\\nbad \\ud83d"}\n')
    return refused(c.cli(["index", "build", "--corpus", "c.jsonl", "--out", "idx"]), ["c.jsonl", "line 2"])


@case("4", "index corpus: id 5 (a number) and text null")
def r4_corpus_types(c):
    c.write("c.jsonl", '{"id": 5, "title": "T", "text": null}\n')
    return refused(c.cli(["index", "build", "--corpus", "c.jsonl", "--out", "idx"]), ["c.jsonl", "text"])


@case("4", "JSONL with a non-UTF-8 byte on line 2 (math eval)")
def r4_jsonl_latin1(c):
    c.write("d.jsonl", jsonl(MATH_ROWS[:1]).encode() + '{"problem": "caf\u00e9", "answer": "1"}\n'.encode("latin-1"))
    return refused(eval_math(c, "d.jsonl"), ["d.jsonl", "line 2"])


@case("4", "JSONL that starts with a UTF-8 byte-order mark")
def r4_jsonl_bom(c):
    c.write("d.jsonl", b"\xef\xbb\xbf" + jsonl(MATH_ROWS).encode())
    r = eval_math(c, "d.jsonl")
    if r.rc == 0 and not has_tb(r):
        return HELD, "read (BOM skipped)"
    return refused(r, ["d.jsonl", "line 1"])


@case("4", "corpus JSONL with a non-UTF-8 byte on line 2 (index build)")
def r4_corpus_latin1(c):
    latin1 = '{"id": "9", "title": "Caf\u00e9", "text": "x"}\n'.encode("latin-1")
    c.write("c.jsonl", jsonl(CORPUS[:1]).encode() + latin1)
    return refused(c.cli(["index", "build", "--corpus", "c.jsonl", "--out", "idx"]), ["c.jsonl", "line 2"])


@case("4", "a KEY=VALUE override whose value holds a non-UTF-8 byte (argv bytes: wandb_project=\\xff)")
def r4_override_bytes(c):
    c.note("the override's value is the single byte 0xff, passed as raw argv bytes")
    cmd = [PY.encode(), b"-m", b"emapg", b"train", b"--config", b"smoke", b"--out", b"run",
           *[t.encode() for t in TINY], b"steps=1", b"wandb_project=x\xff"]
    c.repro.append("emapg train --config smoke --out run " + " ".join(TINY) + " steps=1 $'wandb_project=x\\xff'")
    p = subprocess.run(cmd, cwd=c.dir, env=ENV, capture_output=True, timeout=120, preexec_fn=_limits(AS_LIMIT, None))
    r = Result("train", p.returncode, p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace"),
               False, 0, 120)
    c.outputs.append(f"[exit {r.rc}]\n{r.tail()}")
    if r.rc == 0 and not has_tb(r):
        return HELD, "ran"
    return refused(r, ["wandb_project"])


@case("4", "`export RUN --out DIR` where DIR's name holds a non-UTF-8 byte")
def r4_export_out_bytes(c):
    c.copy_run()
    c.repro.append("emapg export run --out $'exp\\xff'")
    p = subprocess.run([PY.encode(), b"-m", b"emapg", b"export", b"run", b"--out", b"exp\xff"], cwd=c.dir,
                       env=ENV, capture_output=True, timeout=120, preexec_fn=_limits(AS_LIMIT, None))
    r = Result("export", p.returncode, p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace"),
               False, 0, 120)
    c.outputs.append(f"[exit {r.rc}]\n{r.tail()}")
    if r.rc != 0 and "not UTF-8" in r.text:  # emapg's rule: arguments are UTF-8 text; a refusal naming it holds
        return refused(r, ["exp", "not UTF-8"])
    return succeeded(r) or (HELD, "exported")


@case("4", "`eval --data FILE` whose file name holds a non-UTF-8 byte (the set's name)")
def r4_eval_name_bytes(c):
    (c.dir / os.fsdecode(b"caf\xe9.jsonl")).write_text(jsonl(MATH_ROWS[:1]))
    c.repro.append("printf '{\"problem\": \"What is 1 + 1?\", \"answer\": \"2\"}\\n' > $'caf\\xe9.jsonl'")
    c.repro.append("emapg eval --model tiny-llama --task math --data $'caf\\xe9.jsonl' --size 1 --max-new-tokens 2 "
                   "--out ev")
    p = subprocess.run([PY.encode(), b"-m", b"emapg", b"eval", b"--model", b"tiny-llama", b"--task", b"math",
                        b"--data", b"caf\xe9.jsonl", b"--size", b"1", b"--max-new-tokens", b"2", b"--out", b"ev"],
                       cwd=c.dir, env=ENV, capture_output=True, timeout=120, preexec_fn=_limits(AS_LIMIT, None))
    r = Result("eval", p.returncode, p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace"),
               False, 0, 120)
    c.outputs.append(f"[exit {r.rc}]\n{r.tail()}")
    if r.rc != 0 and "not UTF-8" in r.text:  # emapg's rule: arguments are UTF-8 text; a refusal naming it holds
        return refused(r, ["caf", "not UTF-8"])
    return succeeded(r) or (HELD, "ran")


@case("4", "math eval --data: NUL characters inside a problem")
def r4_math_nul(c):
    c.write("d.jsonl", '{"problem": "What is 1 + 1?\\u0000\\u0000", "answer": "2"}\n')
    r = eval_math(c, "d.jsonl")
    return succeeded(r) or (HELD, "ran")


# =========================================================================================================
# Root 5: shared folders running code (plugins named by a run folder's config.yaml)

EVIL = "open({marker!r}, 'w').write('plugin code ran')\n"


def _evil_run(c):
    run = c.copy_run()
    marker = str(c.dir / "PWNED")
    c.write("evil.py", EVIL.format(marker=marker))
    c.sh(f"sed -i 's|^plugins: .*|plugins: [{c.dir / 'evil.py'}]|' run/config.yaml")
    return run, Path(marker)


@case("5", "`eval --run RUN` where RUN/config.yaml names a plugin (no --trust-plugins)")
def r5_eval_run_plugin(c):
    _, marker = _evil_run(c)
    r = c.cli(["eval", "--run", "run", "--size", "2", "--max-new-tokens", "2"])
    if marker.exists():
        return WRONG, "the run folder's plugin code ran without --trust-plugins"
    return refused(r, ["--trust-plugins", "evil.py"])


@case("5", "`export RUN` where RUN/config.yaml names a plugin (no --trust-plugins)")
def r5_export_plugin(c):
    _, marker = _evil_run(c)
    r = c.cli(["export", "run"])
    if marker.exists():
        return WRONG, "the run folder's plugin code ran without --trust-plugins"
    return refused(r, ["--trust-plugins"])


@case("5", "`train --resume RUN` where RUN/config.yaml names a plugin (no --trust-plugins)")
def r5_resume_plugin(c):
    _, marker = _evil_run(c)
    r = c.cli(["train", "--resume", "run", "steps=3"])
    if marker.exists():
        return WRONG, "the run folder's plugin code ran without --trust-plugins"
    return refused(r, ["--trust-plugins"])


@case("5", "`eval --run RUN` where RUN/config.yaml `extends:` a file beside it that names a plugin")
def r5_extends_plugin(c):
    c.copy_run()
    marker = c.dir / "PWNED"
    c.write("evil.py", EVIL.format(marker=str(marker)))
    c.write("run/base.yaml", f"plugins: [{c.dir / 'evil.py'}]\n")
    c.sh("sed -i '/^plugins:/d' run/config.yaml && sed -i '1i extends: base' run/config.yaml")
    r = c.cli(["eval", "--run", "run", "--size", "2", "--max-new-tokens", "2"])
    if marker.exists():
        return WRONG, "the plugin named through extends ran without --trust-plugins"
    return refused(r, ["--trust-plugins"])


@case("5", "`eval --run RUN` whose config.yaml gives plugins as a string (not a list), no --trust-plugins")
def r5_plugins_string(c):
    c.copy_run()
    marker = c.dir / "PWNED"
    c.write("evil.py", EVIL.format(marker=str(marker)))
    c.sh(f"sed -i 's|^plugins: .*|plugins: {c.dir / 'evil.py'}|' run/config.yaml")
    r = c.cli(["eval", "--run", "run", "--size", "2", "--max-new-tokens", "2"])
    if marker.exists():
        return WRONG, "plugin code ran without --trust-plugins"
    v = refused(r, ["plugins"])
    if v[0] == HELD and "(/, t, m, p" in r.err:
        return UNCLEAR, "refused, but the message lists the path letter by letter: " + err_line(r)[:200]
    return v


@case("5", "`compare --report-only` over a copied comparison whose run config.yaml names a plugin")
def r5_compare_report_plugin(c):
    _spec(c, f"base: {SMOKE}\n" + SPEC_OK)
    _fake_compare_out(c)
    marker = c.dir / "PWNED"
    c.write("evil.py", EVIL.format(marker=str(marker)))
    c.sh(f"sed -i 's|^plugins: .*|plugins: [{c.dir / 'evil.py'}]|' out/a/seed0/config.yaml")
    r = c.cli(["compare", "--spec", "spec.yaml", "--out", "out", "--report-only"])
    if marker.exists():
        return WRONG, "plugin code named by a run's config.yaml ran during a report"
    return succeeded(r) or (HELD, "reported; no plugin imported")


@case("5", "`eval --model DIR` where DIR/config.json declares auto_map custom code (trust_remote_code off)")
def r5_model_remote_code(c):
    c.sh(f"cp -r {FIX / 'run/export/policy'} m")
    marker = c.dir / "PWNED"
    cfgj = json.loads((c.dir / "m/config.json").read_text())
    cfgj["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig",
                        "AutoModelForCausalLM": "modeling_evil.EvilModel"}
    c.write("m/config.json", json.dumps(cfgj))
    c.write("m/configuration_evil.py", EVIL.format(marker=str(marker)) +
            "from transformers import LlamaConfig\nclass EvilConfig(LlamaConfig):\n    pass\n")
    c.write("m/modeling_evil.py", EVIL.format(marker=str(marker)) +
            "from transformers import LlamaForCausalLM\nclass EvilModel(LlamaForCausalLM):\n    pass\n")
    r = c.cli(["eval", "--model", "m", "--task", "arithmetic", "--size", "2", "--max-new-tokens", "2"])
    if marker.exists():
        return WRONG, "the model folder's custom code ran"
    return succeeded(r) or (HELD, "ran without importing the folder's code")


@case("5", "a config's own plugin calls sys.exit(3) on import")
def r5_plugin_sysexit(c):
    c.write("p.py", "import sys\nsys.exit(3)\n")
    r = c.cli(["train", "--config", "smoke", "--out", "run", *TINY, "plugins=[p.py]"])
    return refused(r, ["p.py"])


@case("5", "a config's own plugin parses the command line with argparse on import")
def r5_plugin_argparse(c):
    c.write("p.py", "import argparse\np = argparse.ArgumentParser()\np.add_argument('--lr', required=True)\n"
                    "p.parse_args()\n")
    r = c.cli(["train", "--config", "smoke", "--out", "run", *TINY, "plugins=[p.py]"])
    return refused(r, ["p.py"])


@case("5", "a plugin that raises on import")
def r5_plugin_raises(c):
    c.write("p.py", "raise RuntimeError('boom')\n")
    r = c.cli(["train", "--config", "smoke", "--out", "run", *TINY, "plugins=[p.py]"])
    return refused(r, ["p.py", "boom"])


@case("5", "a plugin file that does not exist")
def r5_plugin_missing(c):
    r = c.cli(["train", "--config", "smoke", "--out", "run", *TINY, "plugins=[nope.py]"])
    return refused(r, ["nope.py"])


@case("5", "`eval --plugins p.py` where p.py calls sys.exit(0) on import")
def r5_eval_plugin_exit0(c):
    c.write("p.py", "import sys\nsys.exit(0)\n")
    r = c.cli(["eval", "--plugins", "p.py", "--model", "tiny-llama", "--task", "arithmetic", "--size", "2",
               "--max-new-tokens", "2"])
    return refused(r, ["p.py"])


@case("5", "`serve-retriever --plugins p.py` where p.py parses argv on import")
def r5_serve_plugin_argparse(c):
    c.write("p.py", "import argparse\nargparse.ArgumentParser().parse_args()\n")
    return serve_refused(c, ["--plugins", "p.py", "--index", str(FIX / "idx"), "--port", "0"], ["p.py"])


@case("5", "a plugin task with **kwargs given task_args it does not use (typo)")
def r5_plugin_kwargs(c):
    c.write("p.py", textwrap.dedent("""
        from emapg.tasks import register_task
        from emapg.tasks.arithmetic import ArithmeticTask
        class Loose(ArithmeticTask):
            name = "loose"
            def __init__(self, digits: int = 1, **kwargs):
                super().__init__(digits=digits, **kwargs)
        register_task("loose", Loose)
    """))
    c.write("c.yaml", "extends: smoke\ntask: loose\nplugins: [p.py]\ntask_args: {digitz: 2}\n")
    r = c.cli(["train", "--config", "c.yaml", "--out", "run", *TINY])
    return refused(r, ["digitz"])


# =========================================================================================================
# Root 6: unbounded work on model output (budget: 1 s of CPU per completion; the child is killed at 60 s)

BUDGET_S = 1.0
GRADER_CALLS = {
    "lenient": ("from emapg.rewards.math import math_reward as f", "f(C, G)", "1"),
    "reference": ("from emapg.rewards.math_reference import reference_math_reward as f", "f(C, G)", "\\frac{1}{2}"),
    "search": ("from emapg.tags import extract_answer\nfrom emapg.rewards.qa import qa_em",
               "(lambda a: 0.0 if a is None else qa_em(a, [G]))(extract_answer(C))", "Paris"),
    "qa_f1": ("from emapg.rewards.qa import qa_f1 as f", "f(C, [G])", "Paris"),
    "boxed_format": ("from emapg.rewards.math import boxed_format_reward as f", "f(C)", ""),
    "arithmetic": ("from emapg.tasks.arithmetic import parse_last_integer as f", "f(C)", ""),
}
PATHOLOGICAL = {  # name: (python expression of the completion, which graders)
    "boxed_open_x10k": ('"\\\\boxed{" * 10000', ["lenient", "reference", "boxed_format"]),
    "braces_open_70k": ('"{" * 70000', ["lenient", "reference"]),
    "frac_open_x10k": ('"\\\\frac{" * 10000', ["lenient", "reference"]),
    "sqrt_open_x10k": ('"\\\\sqrt{" * 10000', ["lenient"]),
    "parens_70k": ('"(" * 70000', ["lenient"]),
    "power_chain_35k": ('"x^" * 35000', ["lenient"]),
    "dollars_70k": ('"$" * 70000', ["lenient"]),
    "left_paren_x10k": ('"\\\\left(" * 10000', ["lenient"]),
    "pmatrix_x4600": ('"\\\\begin{pmatrix}" * 4600', ["lenient"]),
    "boxed_70k_digits": ('"\\\\boxed{" + "1" * 70000 + "}"', ["lenient", "reference", "arithmetic"]),
    "boxed_tuple_35k": ('"\\\\boxed{(" + "1," * 35000 + "1)}"', ["lenient", "reference"]),
    "words_70k": ('"the answer is " * 5000', ["lenient", "search", "qa_f1"]),
    "boxed_factorial": ('"\\\\boxed{99999999!}"', ["lenient", "reference"]),
    "boxed_power_tower": ('"\\\\boxed{9**9**9}"', ["lenient", "reference"]),
    "boxed_latex_tower": ('"\\\\boxed{10^{10^{10}}}"', ["lenient", "reference"]),
    "think_end_x9k": ('"</think>" * 9000', ["reference"]),
    "box_marker_open_x4k": ('"<|begin_of_box|>" * 4000 + "<|end_of_box|>"', ["reference"]),
    "boxed_frac_chain": ('"\\\\boxed{" + "\\\\frac" * 14000 + "}"', ["reference"]),
    "boxed_sqrt_chain": ('"\\\\boxed{" + "\\\\sqrt" * 14000 + "}"', ["reference"]),
    "boxed_slash_35k": ('"\\\\boxed{" + "1/" * 35000 + "2}"', ["reference"]),
    "answer_open_x9k": ('"<answer>" * 9000', ["search"]),
    "answer_open_x4k": ('"<answer>" * 4000', ["search"]),
    "information_open_x5k": ('"<information>" * 5000 + "<answer>x</answer>"', ["search"]),
    "answer_pairs_x4k": ('"<answer>x</answer>" * 4000', ["search"]),
    "digits_commas_35k": ('"1," * 35000', ["arithmetic"]),
}


def _grader_case(grader: str, name: str, expr: str):
    imp, call, gold = GRADER_CALLS[grader]

    def fn(c):
        code = (f"import json, time, logging\nlogging.disable(logging.CRITICAL)\n{imp}\nC = {expr}\nG = {gold!r}\n"
                "best = None\nfor _ in range(2):  # the faster of two calls, in CPU time: the work, not the machine's "
                "other load\n"
                f"    t = time.process_time()\n    v = {call}\n    s = time.process_time() - t\n"
                "    best = s if best is None else min(best, s)\n"
                "print(json.dumps({'seconds': best, 'chars': len(C), 'value': repr(v)[:80]}))")
        r = c.py(code, timeout=60)
        if r.timed_out:
            return HANG, f"the grader did not return within 60 s on a {name} completion"
        if has_tb(r):
            return TB, f"the grader raised on model output: {tb_last(r)}"
        info = json.loads(r.out.strip().splitlines()[-1])
        what = f"{info['seconds']:.2f} s on {info['chars']} chars (value {info['value']})"
        return (HANG, f"over the {BUDGET_S:g} s budget: {what}") if info["seconds"] > BUDGET_S else (HELD, what)
    fn.__name__ = f"r6_{grader}_{name}"
    return fn


for _name, (_expr, _graders) in PATHOLOGICAL.items():
    for _g in _graders:
        case("6", f"{_g} grader on a {_name} completion (budget {BUDGET_S:g} s)")(_grader_case(_g, _name, _expr))


@case("6", "the agent's turn cut (_cut) on a 20,000-token turn without a stop string")
def r6_agent_cut(c):
    code = """
        import json, time
        from emapg.models.zoo import load_model
        from emapg.rollout.agent import _cut
        _, tok = load_model("tiny-llama")
        ids = tok.encode("abc " * 10000, add_special_tokens=False)[:20000]
        t = time.perf_counter(); n = _cut(tok, ids, set()); s = time.perf_counter() - t
        print(json.dumps({"seconds": s, "tokens": len(ids)}))
    """
    r = c.py(code, timeout=120)
    if r.timed_out:
        return HANG, "did not return within 120 s"
    if has_tb(r):
        return TB, tb_last(r)
    info = json.loads(r.out.strip().splitlines()[-1])
    what = f"{info['seconds']:.2f} s for {info['tokens']} tokens"
    return (HANG, f"over budget: {what}") if info["seconds"] > 5 else (HELD, what)


# =========================================================================================================
# Root 7: grading edge cases (a gold that normalises to nothing, empty gold lists, ...)

def _gold_case(c, gold, grader: str, completions: list[str]):
    """Load a one-row math file with this gold through `emapg eval` (accepted?), then score completions; with the
    reference grader, the verdict itself: the reference keeps such a row and grades it by its rules (issue 69), so
    emapg keeps it too, graded alike, and must say so."""
    c.write("d.jsonl", json.dumps({"problem": "What is it?", "answer": gold}) + "\n")
    r = eval_math(c, "d.jsonl", "--grader", grader)
    if r.timed_out or has_tb(r):
        return refused(r)
    if r.rc != 0:
        return refused(r, ["d.jsonl", "line 1"])
    fn = ("from emapg.rewards.math_reference import reference_math_reward as f" if grader == "reference" else
          "from emapg.rewards.math import math_reward as f")
    p = c.py(f"import json\n{fn}\nprint(json.dumps({{c: f(c, {gold!r}) for c in {completions!r}}}))")
    if p.rc != 0:
        return PROBE_ERR, p.tail()
    scores = json.loads(p.out.strip().splitlines()[-1])
    if grader == "reference":  # issue 69: the reference loads such a row and grades it by its rules; emapg too, said
        warned = "warning" in r.err and "reads as nothing" in r.err and "d.jsonl" in r.err
        return (HELD if warned else WRONG), (f"kept with a warning naming the row, graded as the reference: {scores}"
                                             if warned else f"accepted without a word: {scores}")
    return None, scores


@case("7", "reference grader: gold \"\\boxed{}\" (an empty box): kept as the reference keeps it, said")
def r7_ref_gold_empty_box(c):
    return _gold_case(c, "\\boxed{}", "reference", ["\\boxed{}", "\\boxed{ }", "\\boxed{7}"])


@case("7", "reference grader: gold \"\\boxed{\" (unclosed): kept as the reference keeps it, said")
def r7_ref_gold_unclosed(c):
    return _gold_case(c, "\\boxed{", "reference", ["\\boxed{\\boxed{}", "\\boxed{}", "\\boxed{1}"])


@case("7", "reference grader: gold \"{}\": kept as the reference keeps it, said")
def r7_ref_gold_braces(c):
    return _gold_case(c, "{}", "reference", ["\\boxed{}", "\\boxed{{}}", "\\boxed{1}"])


@case("7", "reference grader: gold \"\\text{}\" (normalises to nothing): kept as the reference keeps it, said")
def r7_ref_gold_text_empty(c):
    return _gold_case(c, "\\text{}", "reference", ["\\boxed{}", "\\boxed{\\text{}}", "\\boxed{x}"])


@case("7", "lenient grader: gold \".\" (nothing math-verify can parse): accepted, no completion can score")
def r7_len_gold_dot(c):
    v, scores = _gold_case(c, ".", "lenient", ["\\boxed{.}", ".", "\\boxed{}"])
    if v:
        return v, scores
    if not any(scores.values()):
        return WRONG, f"accepted (exit 0), yet no completion can score, not even the gold itself: {scores}"
    return HELD, f"scores {scores}"


@case("7", "lenient grader: gold \"\\text{}\"")
def r7_len_gold_text_empty(c):
    v, scores = _gold_case(c, "\\text{}", "lenient", ["\\boxed{\\text{}}", "\\boxed{}", "\\boxed{1}"])
    if v:
        return v, scores
    if not any(scores.values()):
        return WRONG, f"accepted (exit 0), yet no completion can score: {scores}"
    if scores.get("\\boxed{}") == 1.0:
        return WRONG, f"an empty box scores: {scores}"
    return HELD, f"scores {scores}"


@case("7", "lenient grader: gold \"\\boxed{}\"")
def r7_len_gold_empty_box(c):
    v, scores = _gold_case(c, "\\boxed{}", "lenient", ["\\boxed{}", "\\boxed{1}", ""])
    if v:
        return v, scores
    if scores.get("\\boxed{}") == 1.0 or scores.get("") == 1.0:
        return WRONG, f"an empty answer scores: {scores}"
    if not any(scores.values()):
        return WRONG, f"accepted (exit 0), yet no completion can score: {scores}"
    return HELD, f"scores {scores}"


@case("7", "math gold \"$ $\" (empty once its dollars go): refused")
def r7_gold_dollars(c):
    c.write("d.jsonl", json.dumps({"problem": "p", "answer": "$ $"}) + "\n")
    return refused(eval_math(c, "d.jsonl"), ["d.jsonl", "line 1", "answer"])


@case("7", "math gold list [\"3\", \"\"]: refused")
def r7_gold_list_empty_item(c):
    c.write("d.jsonl", json.dumps({"problem": "p", "answer": ["3", ""]}) + "\n")
    return refused(eval_math(c, "d.jsonl"), ["d.jsonl", "line 1"])


@case("7", "OlympiadBench row: is_multiple_answer true with final_answer []")
def r7_olympiad_empty(c):
    c.write("d.jsonl", json.dumps({"question": "p", "final_answer": [], "is_multiple_answer": True}) + "\n")
    return refused(eval_math(c, "d.jsonl"), ["d.jsonl", "line 1"])


@case("7", "search data: golden_answers [] refused")
def r7_qa_gold_empty(c):
    c.write("d.jsonl", jsonl([{"id": "0", "question": "q?", "golden_answers": []}]))
    return refused(eval_qa(c, "d.jsonl"), ["d.jsonl", "line 1"])


@case("7", "search data: golden_answers [\"the\", \"!\"] (all normalise to nothing) refused")
def r7_qa_gold_articles(c):
    c.write("d.jsonl", jsonl([{"id": "0", "question": "q?", "golden_answers": ["the", "!"]}]))
    return refused(eval_qa(c, "d.jsonl"), ["d.jsonl", "line 1"])


@case("7", "search EM/F1: an empty or article-only <answer> never scores against any gold")
def r7_qa_empty_pred(c):
    p = c.py("""
        from emapg.rewards.qa import qa_em, qa_f1
        from emapg.tags import extract_answer
        out = {}
        for comp in ["<answer></answer>", "<answer> the </answer>", "<answer>!!</answer>"]:
            a = extract_answer(comp)
            out[comp] = (qa_em(a, ["the Paris"]), qa_f1(a, ["a", "Paris"]))
        print(out)
    """)
    if p.rc != 0:
        return TB, tb_last(p)
    return (WRONG, p.out.strip()) if "1.0" in p.out else (HELD, p.out.strip())


@case("7", "search: an answer the environment's invalid-action text quotes is not taken as the model's")
def r7_invalid_action_answer(c):
    p = c.py("""
        from emapg.tags import extract_answer, INVALID_ACTION
        print(repr(extract_answer("I think" + INVALID_ACTION)))
    """)
    return (HELD, p.out.strip()) if p.out.strip() == "None" else (WRONG, p.out.strip())


@case("7", "lenient grader: gold \"1,000\" against \\boxed{1000}, gold \"025\" against \\boxed{25}")
def r7_len_thousands(c):
    p = c.py("""
        from emapg.rewards.math import math_reward as f
        print(f("\\\\boxed{1000}", "1,000"), f("\\\\boxed{25}", "025"), f("\\\\boxed{1,2}", "12"))
    """)
    vals = p.out.split()
    return (HELD, p.out.strip()) if vals[:3] == ["1.0", "1.0", "0.0"] else (WRONG, p.out.strip())


@case("7", "reference grader: a truncated response scores 0 even when its box is right (training run's rule)")
def r7_ref_truncated(c):
    p = c.py("""
        from emapg.tasks.math import MathTask
        import json
        open("d.jsonl", "w").write(json.dumps({"problem": "p", "answer": "2"}) + "\\n")
        t = MathTask(eval_file="d.jsonl", grader="reference")
        print(t.zero_truncated, t.eval_reward("\\\\boxed{2}", t.eval_examples(1)[0]))
    """)
    return (HELD, p.out.strip()) if p.out.split()[:1] == ["True"] else (WRONG, p.out.strip())


# =========================================================================================================
# Root 8: `emapg plan` accepting what train refuses; plan's own inputs

def _model_dir(c, **changes) -> str:
    c.sh(f"cp -r {FIX / 'run/export/policy'} m")
    cfgj = json.loads((c.dir / "m/config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfgj.pop(k, None)
        else:
            cfgj[k] = v
    c.write("m/config.json", json.dumps(cfgj))
    return "m"


def _plan_refuses(c, args, must, train_args=None, timeout=120):
    r = c.cli(["plan", "--config", "smoke", *args], timeout=timeout)
    if r.rc == 0 and not has_tb(r) and not r.timed_out:
        if "does not run" in r.out or "refuses" in r.out:
            return HELD, "the plan says train refuses it: " + next(
                (ln for ln in r.out.splitlines() if "refuses" in ln or "does not run" in ln), "")[:300]
        if train_args is not None:
            t = c.cli(["train", "--config", "smoke", "--out", "run", *TINY, *train_args])
            if t.rc != 0 and has_tb(t):
                return TB, (f"plan calls it a fit ({tail_lines(r.out, 1)}), and train fails with a traceback: "
                            f"{tb_last(t)}")
            if t.rc != 0:
                return WRONG, f"plan calls it a fit ({tail_lines(r.out, 1)}) while train refuses it: {err_line(t)}"
            return HELD, "plan and train both accept it"
        return WRONG, f"plan accepted it: {tail_lines(r.out, 2)}"
    return refused(r, must)


@case("8", "plan --gpus 3 with prompts_per_step 4 (train on 3 processes refuses)")
def r8_plan_gpus_not_dividing(c):
    return _plan_refuses(c, ["--gpus", "3"], ["prompts_per_step"])


@case("8", "plan --gpus 0 / -2")
def r8_plan_gpus_zero(c):
    a = refused(c.cli(["plan", "--config", "smoke", "--gpus", "0"]), ["--gpus"])
    b = refused(c.cli(["plan", "--config", "smoke", "--gpus", "-2"]), ["--gpus"])
    return a if a[0] != HELD else b


@case("8", "plan --gpu-memory nan / inf / -1")
def r8_plan_memory_nan(c):
    for v in ("nan", "inf", "-1"):
        res = refused(c.cli(["plan", "--config", "smoke", "--gpu-memory", v]), ["--gpu-memory"])
        if res[0] != HELD:
            return res[0], f"--gpu-memory {v}: {res[1]}"
    return HELD, "all three refused naming --gpu-memory"


@case("8", "plan --response-tokens 0 (an invalid length)")
def r8_plan_response_zero(c):
    r = c.cli(["plan", "--config", "smoke", "--response-tokens", "0"])
    if r.rc == 0 and not has_tb(r):
        m = re.search(r"responses up to (\d+)", r.out)
        return WRONG, (f"accepted --response-tokens 0 and planned for responses up to {m.group(1) if m else '?'} "
                       "tokens instead (0 read as 'not given')")
    return refused(r, ["--response-tokens"])


@case("8", "plan --prompt-tokens 0")
def r8_plan_prompt_zero(c):
    return refused(c.cli(["plan", "--config", "smoke", "--prompt-tokens", "0"]), ["--prompt-tokens"])


@case("8", "plan of a model whose config.json has hidden_size 0")
def r8_plan_hidden_zero(c):
    return _plan_refuses(c, ["model=" + _model_dir(c, hidden_size=0)], ["hidden_size"])


@case("8", "plan of a model whose config.json has num_hidden_layers 0")
def r8_plan_layers_zero(c):
    return _plan_refuses(c, ["model=" + _model_dir(c, num_hidden_layers=0)], ["num_hidden_layers"])


@case("8", "plan of a model with num_key_value_heads 0")
def r8_plan_kv_zero(c):
    m = _model_dir(c, num_key_value_heads=0)
    return _plan_refuses(c, ["model=" + m], ["num_key_value_heads"], train_args=["model=" + m])


@case("8", "plan of a model with num_key_value_heads 3 (does not divide 4 attention heads)")
def r8_plan_kv_not_dividing(c):
    m = _model_dir(c, num_key_value_heads=3)
    return _plan_refuses(c, ["model=" + m], ["num_key_value_heads"], train_args=["model=" + m])


@case("8", "plan of a model with head_dim 0")
def r8_plan_head_dim_zero(c):
    m = _model_dir(c, head_dim=0)
    return _plan_refuses(c, ["model=" + m], ["head_dim"], train_args=["model=" + m])


@case("8", "plan of a model with hidden_size 64.5 (a float)")
def r8_plan_hidden_float(c):
    return _plan_refuses(c, ["model=" + _model_dir(c, hidden_size=64.5)], ["hidden_size"])


@case("8", "plan of a model with vocab_size null")
def r8_plan_vocab_null(c):
    m = _model_dir(c, vocab_size=None)
    return _plan_refuses(c, ["model=" + m], ["vocab_size"], train_args=["model=" + m])


@case("8", "plan of a model folder whose config.json is not JSON")
def r8_plan_config_garbage(c):
    _model_dir(c)
    c.write("m/config.json", "{garbage")
    return refused(c.cli(["plan", "--config", "smoke", "model=m"]), ["m"])


@case("8", "plan of a huge config (hidden 65536, 1000 layers, vocab 10^8): bounded time and memory")
def r8_plan_huge(c):
    m = _model_dir(c, hidden_size=65536, intermediate_size=262144, num_hidden_layers=1000, vocab_size=10**8,
                   num_attention_heads=512, num_key_value_heads=64, head_dim=128)
    c.note("a 70B config's plan takes about 75 s and 6 GB here too (its layer is measured): the cap is 12 GiB")
    r = c.cli(["plan", "--config", "smoke", "model=" + m], timeout=180, as_limit=12 * 2**30)
    if r.timed_out:
        return HANG, "no plan within 180 s"
    if has_tb(r):
        return TB, tb_last(r)
    if r.rc != 0:
        return HELD, "refused: " + err_line(r)
    return HELD, f"planned in {r.seconds:.0f} s: {tail_lines(r.out, 1)}"


@case("8", "plan of an absurd config (hidden 2^31, vocab 2^40): bounded time and memory")
def r8_plan_absurd(c):
    m = _model_dir(c, hidden_size=2**31, intermediate_size=2**33, num_hidden_layers=10**6, vocab_size=2**40,
                   num_attention_heads=2**20, num_key_value_heads=2**20, head_dim=2**11)
    r = c.cli(["plan", "--config", "smoke", "model=" + m], timeout=120)
    if r.timed_out:
        return HANG, f"no plan within 120 s (or killed at the {AS_LIMIT >> 30} GiB address-space cap)"
    if has_tb(r):
        return TB, tb_last(r)
    return HELD, (f"refused: {err_line(r)}" if r.rc else f"planned in {r.seconds:.0f} s: {tail_lines(r.out, 1)}")


@case("8", "plan with rollout.n=0 (the config check refuses, as train does)")
def r8_plan_n_zero(c):
    return refused(c.cli(["plan", "--config", "smoke", "rollout.n=0"]), ["rollout.n"])


@case("8", "plan with offload=true on 1 device (train refuses offload on one process)")
def r8_plan_offload_one(c):
    return _plan_refuses(c, ["offload=true"], ["offload"])


@case("8", "plan with micro_batch_tokens=1 (a micro-batch budget below one row)")
def r8_plan_micro_tokens(c):
    return _plan_refuses(c, ["micro_batch_tokens=1"], ["micro_batch_tokens"], train_args=["micro_batch_tokens=1"])


@case("8", "plan --device cpu --gpus 2 with prompts_per_step 3")
def r8_plan_cpu_split(c):
    return _plan_refuses(c, ["--device", "cpu", "--gpus", "2", "prompts_per_step=3", "micro_batch_prompts=1"],
                         ["prompts_per_step"])


# =========================================================================================================
# Root 9: messages that say what and where

def _train(c, *args, timeout=DEFAULT_TIMEOUT):
    return c.cli(["train", "--config", "smoke", "--out", "run", *TINY, *args], timeout=timeout)


@case("9", "an unknown override beside a bad value: both named")
def r9_unknown_and_bad(c):
    return refused(_train(c, "algo.etaa=0.9", "steps=abc"), ["etaa", "steps"])


@case("9", "two bad values: both named")
def r9_two_bad(c):
    return refused(_train(c, "steps=-1", "lr=abc"), ["steps", "lr"])


@case("9", "a config file that is not UTF-8: names the file and the line")
def r9_config_binary(c):
    c.write("c.yaml", b"extends: smoke\nsteps: 2\n# caf\xe9\n")
    return refused(c.cli(["train", "--config", "c.yaml", "--out", "run", *TINY]), ["c.yaml", "line 3"])


@case("9", "`extends:` a file that is not UTF-8")
def r9_extends_binary(c):
    c.write("base.yaml", b"model: tiny-llama\n# caf\xe9\n")
    c.write("c.yaml", "extends: base\n")
    return refused(c.cli(["plan", "--config", "c.yaml"]), ["base.yaml"])


@case("9", "`extends:` a file that does not exist")
def r9_extends_missing(c):
    c.write("c.yaml", "extends: nope\n")
    return refused(c.cli(["plan", "--config", "c.yaml"]), ["nope"])


@case("9", "`extends:` itself (a cycle)")
def r9_extends_cycle(c):
    c.write("a.yaml", "extends: b\n")
    c.write("b.yaml", "extends: a\n")
    return refused(c.cli(["plan", "--config", "a.yaml"]), ["cycle"])


@case("9", "`extends: 5`")
def r9_extends_int(c):
    c.write("c.yaml", "extends: 5\n")
    return refused(c.cli(["plan", "--config", "c.yaml"]), ["extends"])


@case("9", "`extends:` a file whose YAML is a list")
def r9_extends_list(c):
    c.write("base.yaml", "- a\n")
    c.write("c.yaml", "extends: base\n")
    return refused(c.cli(["plan", "--config", "c.yaml"]), ["base.yaml"])


@case("9", "`extends:` a directory")
def r9_extends_dir(c):
    (c.dir / "base.yaml").mkdir()
    c.repro.append("mkdir base.yaml")
    c.write("c.yaml", "extends: base\n")
    return refused(c.cli(["plan", "--config", "c.yaml"]), ["base.yaml"])


@case("9", "a config with invalid YAML names the line")
def r9_config_bad_yaml(c):
    c.write("c.yaml", "steps: 2\nalgo: {eta: 0.9\n")
    return refused(c.cli(["plan", "--config", "c.yaml"]), ["c.yaml", "line"])


@case("9", "`lr: 1e-3` in YAML (PyYAML reads it as a string)")
def r9_lr_string(c):
    c.write("c.yaml", "extends: smoke\nlr: 1e-3\n")
    r = c.cli(["train", "--config", "c.yaml", "--out", "run", *TINY, "steps=1"])
    if r.rc == 0 and not has_tb(r):
        lr = re.search(r"^lr: (.*)$", (c.dir / "run/config.yaml").read_text(), re.M)
        return (HELD, f"read as the number {lr.group(1)}") if lr and lr.group(1) in ("0.001", "1.0e-03") else \
            (WRONG, f"lr recorded as {lr.group(1) if lr else '?'}")
    return refused(r, ["lr", "1e-3"])


@case("9", "`--out X` beside `--resume RUN` is refused, naming both")
def r9_out_with_resume(c):
    c.copy_run()
    return refused(c.cli(["train", "--resume", "run", "--out", "x", "steps=3"]), ["--out", "--resume"])


@case("9", "`--config X` beside `--resume RUN` is refused")
def r9_config_with_resume(c):
    c.copy_run()
    return refused(c.cli(["train", "--resume", "run", "--config", "smoke", "steps=3"]), ["--config", "--resume"])


@case("9", "`--nproc 0`")
def r9_nproc_zero(c):
    return refused(c.cli(["train", "--nproc", "0", "--config", "smoke", "--out", "run"]), ["--nproc"])


@case("9", "`--nproc -3`")
def r9_nproc_negative(c):
    return refused(c.cli(["train", "--nproc", "-3", "--config", "smoke", "--out", "run"]), ["--nproc"])


@case("9", "`init_from` a run of another model (tiny-llama run, tiny-qwen2 policy)")
def r9_init_from_other_model(c):
    c.copy_run("src")
    r = _train(c, "model=tiny-qwen2", f"init_from={c.dir / 'src'}", "steps=1")
    v = refused(r, ["init_from", "src"])
    if v[0] == HELD and "damaged" in r.err and "another" not in r.err:
        return UNCLEAR, ("calls the other model's intact checkpoints 'damaged' instead of saying src is a run of "
                         "another model (tiny-llama): " + err_line(r)[:300])
    return v


@case("9", "`init_from` a folder that is not a run")
def r9_init_from_not_run(c):
    (c.dir / "empty").mkdir()
    c.repro.append("mkdir empty")
    return refused(_train(c, "init_from=empty", "steps=1"), ["init_from", "empty"])


@case("9", "a full disk while checkpointing (file size limit 200 KiB): one line naming the file")
def r9_full_disk(c):
    r = c.cli(["train", "--config", "smoke", "--out", "run", *TINY, "steps=1", "save_every=1"], fsize=200 * 1024)
    if r.rc == 0 and not has_tb(r):
        return WRONG, "exit 0 although files could not be written"
    return refused(r, ["run/"])


@case("9", "a full disk during `index build` (file size limit 8 KiB)")
def r9_full_disk_index(c):
    c.write("c.jsonl", "".join(json.dumps({"id": str(i), "title": f"T{i}", "text": "word " * 50}) + "\n"
                               for i in range(200)), show=False)
    c.note("c.jsonl = 200 passages {id, title, text} of 250 characters")
    r = c.cli(["index", "build", "--corpus", "c.jsonl", "--out", "idx"], fsize=8 * 1024)
    if r.rc == 0 and not has_tb(r):
        return WRONG, "exit 0 although files could not be written"
    return refused(r, ["idx"])


@case("9", "a full disk during `eval --out` (file size limit 1 KiB)")
def r9_full_disk_eval(c):
    c.write("d.jsonl", jsonl(MATH_ROWS * 4))
    r = c.cli(["eval", "--model", "tiny-llama", "--task", "math", "--data", "d.jsonl", "--max-new-tokens", "8",
               "--out", "ev"], fsize=1024)
    if r.rc == 0 and not has_tb(r):
        return WRONG, "exit 0 although files could not be written"
    return refused(r, ["ev/"])


@case("9", "compare seeds [0, 0]")
def r9_compare_seeds_dup(c):
    _spec(c, f"base: {SMOKE}\nseeds: [0, 0]\nconfigs: {{a: [algo.eta=1.0]}}\n")
    return refused(c.cli(["compare", "--spec", "spec.yaml", "--out", "out"]), ["seeds"])


@case("9", "compare config named ../../x")
def r9_compare_name_dotdot(c):
    _spec(c, f"base: {SMOKE}\nseeds: [0]\nconfigs: {{'../../x': [algo.eta=1.0]}}\n")
    r = c.cli(["compare", "--spec", "spec.yaml", "--out", "out"])
    if (c.dir.parent / "x").exists():
        return LOST, "wrote outside --out"
    return refused(r, ["../../x"])


@case("9", "compare config named `.hidden` / `a/b`")
def r9_compare_name_slash(c):
    _spec(c, f"base: {SMOKE}\nseeds: [0]\nconfigs: {{'a/b': [algo.eta=1.0]}}\n")
    return refused(c.cli(["compare", "--spec", "spec.yaml", "--out", "out"]), ["a/b"])


@case("9", "compare --only a config the spec lacks")
def r9_compare_only_unknown(c):
    _spec(c, f"base: {SMOKE}\n" + SPEC_OK)
    return refused(c.cli(["compare", "--spec", "spec.yaml", "--out", "out", "--only", "zzz"]), ["zzz"])


@case("9", "compare --jobs 0")
def r9_compare_jobs_zero(c):
    _spec(c, f"base: {SMOKE}\n" + SPEC_OK)
    r = c.cli(["compare", "--spec", "spec.yaml", "--out", "out", "--jobs", "0"])
    return refused(r, ["--jobs"])


@case("9", "compare with a bad KEY=VALUE on the command line")
def r9_compare_bad_override(c):
    _spec(c, f"base: {SMOKE}\n" + SPEC_OK)
    return refused(c.cli(["compare", "--spec", "spec.yaml", "--out", "out", "algo.eta=7"]), ["algo.eta"])


@case("9", "compare --spec that does not exist")
def r9_compare_spec_missing(c):
    return refused(c.cli(["compare", "--spec", "nope.yaml", "--out", "out"]), ["nope.yaml"])


@case("9", "`--config` a directory")
def r9_config_dir(c):
    (c.dir / "d").mkdir()
    c.repro.append("mkdir d")
    return refused(c.cli(["plan", "--config", "d"]), ["d"])


@case("9", "`--config ''` (an empty name)")
def r9_config_empty_name(c):
    return refused(c.cli(["plan", "--config", ""]), ["--config"])


@case("9", "`--config` an empty file")
def r9_config_empty_file(c):
    c.write("c.yaml", "")
    return refused(c.cli(["plan", "--config", "c.yaml"]), ["c.yaml", "empty"])


@case("9", "train with `model=/nonexistent`")
def r9_model_missing(c):
    return refused(_train(c, "model=/nonexistent/m"), ["model", "/nonexistent/m"])


@case("9", "train with a model folder whose config.json is garbage")
def r9_model_bad_config(c):
    _model_dir(c)
    c.write("m/config.json", "{garbage")
    return refused(_train(c, "model=m"), ["m/config.json"])


@case("9", "train with a model folder missing its weights")
def r9_model_no_weights(c):
    _model_dir(c)
    c.sh("rm m/model.safetensors")
    return refused(_train(c, "model=m"), ["m"])


@case("9", "train with a model folder whose weights are truncated")
def r9_model_weights_cut(c):
    _model_dir(c)
    c.sh("head -c 5000 m/model.safetensors > t && mv t m/model.safetensors")
    return refused(_train(c, "model=m"), ["model.safetensors"])


@case("9", "train with task=nope")
def r9_task_unknown(c):
    c.write("c.yaml", "extends: smoke\ntask: nope\ntask_args: {}\n")
    return refused(c.cli(["train", "--config", "c.yaml", "--out", "run", *TINY]), ["task", "nope"])


@case("9", "train with a task_args typo (task_args.digitz=2)")
def r9_task_args_typo(c):
    return refused(_train(c, "task_args.digitz=2"), ["digitz"])


@case("9", "train with `algo=5` (a section given a number)")
def r9_section_int(c):
    return refused(_train(c, "algo=5"), ["algo"])


@case("9", "train with `task_args=[1, 2]`")
def r9_task_args_list(c):
    return refused(_train(c, "task_args=[1, 2]"), ["task_args"])


@case("9", "train with `rollout.n=2.5`")
def r9_rollout_float(c):
    return refused(_train(c, "rollout.n=2.5"), ["rollout.n"])


@case("9", "train with `steps` (no =)")
def r9_override_no_eq(c):
    return refused(_train(c, "steps"), ["steps"])


@case("9", "train with `algo.eta.x=1` (a field used as a section)")
def r9_override_deep(c):
    return refused(_train(c, "algo.eta.x=1"), ["algo.eta"])


@case("9", "train with `lora.target_modules=q_proj` (a string for a list)")
def r9_target_modules_string(c):
    r = _train(c, "lora.r=4", "lora.target_modules=q_proj", "steps=1")
    return refused(r, ["lora.target_modules"]) if (r.rc != 0 or has_tb(r)) else (HELD, "accepted as one module")


@case("9", "train with `lora.target_modules=[nope]` (no such module)")
def r9_target_modules_unknown(c):
    return refused(_train(c, "lora.r=4", "lora.target_modules=[nope]", "steps=1"), ["nope"])


@case("9", "train with `report_to=[nope]`")
def r9_report_to_unknown(c):
    return refused(_train(c, "report_to=[nope]"), ["report_to"])


@case("9", "train with `device=cuda` on a machine without a GPU")
def r9_device_cuda(c):
    return refused(_train(c, "device=cuda"), ["device"])


@case("9", "train with `dtype=float8`")
def r9_dtype_bad(c):
    return refused(_train(c, "dtype=float8"), ["dtype"])


@case("9", "train with `threads=0`")
def r9_threads_zero(c):
    return refused(_train(c, "threads=0"), ["threads"])


@case("9", "train with `algo.k=-1`")
def r9_k_negative(c):
    return refused(_train(c, "algo.k=-1"), ["algo.k"])


@case("9", "train with `rollout.max_new_tokens=0`")
def r9_max_new_zero(c):
    return refused(_train(c, "rollout.max_new_tokens=0"), ["rollout.max_new_tokens"])


@case("9", "train with `seed=-1`")
def r9_seed_negative(c):
    r = _train(c, "seed=-1", "steps=1")
    return refused(r, ["seed"]) if (r.rc != 0 or has_tb(r)) else (HELD, "accepted seed -1")


@case("9", "train with `seed=99999999999999999999` (beyond 64 bits)")
def r9_seed_huge(c):
    r = _train(c, "seed=99999999999999999999", "steps=1")
    return refused(r, ["seed"]) if (r.rc != 0 or has_tb(r)) else (HELD, "accepted")


@case("9", "train with `steps=1e400` (YAML inf) ")
def r9_steps_inf(c):
    return refused(_train(c, "steps=.inf"), ["steps"])


@case("9", "train with `lr=.nan`")
def r9_lr_nan(c):
    return refused(_train(c, "lr=.nan"), ["lr"])


@case("9", "train --resume a folder that does not exist")
def r9_resume_missing(c):
    return refused(c.cli(["train", "--resume", "nope"]), ["nope"])


@case("9", "train --resume a regular file")
def r9_resume_file(c):
    c.write("f", "x")
    return refused(c.cli(["train", "--resume", "f"]), ["f"])


@case("9", "export a folder that is not a run")
def r9_export_not_run(c):
    (c.dir / "d").mkdir()
    c.repro.append("mkdir d")
    return refused(c.cli(["export", "d"]), ["d"])


@case("9", "export --step 99 (no such checkpoint)")
def r9_export_step_missing(c):
    c.copy_run()
    return refused(c.cli(["export", "run", "--step", "99"]), ["99", "step_000002"])


@case("9", "export --step -1")
def r9_export_step_negative(c):
    c.copy_run()
    return refused(c.cli(["export", "run", "--step", "-1"]), ["--step"])


@case("9", "eval --task-args '[1]'")
def r9_eval_task_args_list(c):
    r = c.cli(["eval", "--model", "tiny-llama", "--task", "arithmetic", "--task-args", "[1]", "--size", "2"])
    return refused(r, ["--task-args"])


@case("9", "eval --task-args \"{digits: 2}\" (not JSON)")
def r9_eval_task_args_yaml(c):
    r = c.cli(["eval", "--model", "tiny-llama", "--task", "arithmetic", "--task-args", "{digits: 2}", "--size", "2"])
    return refused(r, ["--task-args"])


@case("9", "eval --task-args with an unknown key")
def r9_eval_task_args_unknown(c):
    r = c.cli(["eval", "--model", "tiny-llama", "--task", "arithmetic", "--task-args", '{"digitz": 2}', "--size", "2"])
    return refused(r, ["digitz"])


@case("9", "eval --data a file that does not exist")
def r9_eval_data_missing(c):
    return refused(eval_math(c, "nope.jsonl"), ["nope.jsonl"])


@case("9", "eval --data NAME= (an empty file name)")
def r9_eval_data_empty_name(c):
    return refused(eval_math(c, "x="), ["x="])


@case("9", "eval --data an empty file")
def r9_eval_data_empty_file(c):
    c.write("d.jsonl", "")
    return refused(eval_math(c, "d.jsonl"), ["d.jsonl"])


@case("9", "eval --data a .csv file")
def r9_eval_data_csv(c):
    c.write("d.csv", "problem,answer\np,1\n")
    return refused(eval_math(c, "d.csv"), ["d.csv", ".csv"])


@case("9", "eval --data file.parquet that is not Parquet")
def r9_eval_data_fake_parquet(c):
    c.write("d.parquet", "not parquet")
    return refused(eval_math(c, "d.parquet"), ["d.parquet"])


@case("9", "eval --data file.jsonl.gz that is not gzip")
def r9_eval_data_fake_gz(c):
    c.write("d.jsonl.gz", jsonl(MATH_ROWS))
    return refused(eval_math(c, "d.jsonl.gz"), ["d.jsonl.gz"])


@case("9", "eval --data with rows lacking the problem column")
def r9_eval_data_no_problem(c):
    c.write("d.jsonl", jsonl([{"text": "p", "answer": "1"}]))
    return refused(eval_math(c, "d.jsonl"), ["d.jsonl", "line 1", "problem"])


@case("9", "eval --model a folder that does not exist")
def r9_eval_model_missing(c):
    r = c.cli(["eval", "--model", "nope", "--task", "arithmetic", "--size", "2"])
    return refused(r, ["nope"])


@case("9", "eval with no --model and no --run")
def r9_eval_no_model(c):
    return refused(c.cli(["eval", "--task", "arithmetic"]), ["--model"])


def _eval_bad_option(opt, val):
    def fn(c):
        r = c.cli(["eval", "--model", "tiny-llama", "--task", "arithmetic", "--max-new-tokens", "2", opt, val]
                  + ([] if opt == "--size" else ["--size", "2"]))
        if opt == "--seed" and r.rc == 0 and not has_tb(r):
            return HELD, "accepted (a negative seed is a seed, as in training)"
        return refused(r, [opt])
    fn.__name__ = "r9_eval_" + opt.strip("-").replace("-", "_") + "_" + val.replace("-", "neg").replace(".", "_")
    return fn


for _opt, _val in (("--size", "0"), ("--size", "-3"), ("--batch-size", "0"), ("--samples", "0"), ("--top-p", "2"),
                   ("--top-p", "0"), ("--max-new-tokens", "0"), ("--temperature", "-1"), ("--dtype", "float8"),
                   ("--seed", "-1"), ("--device", "tpu"), ("--backend", "nope")):
    case("9", f"eval {_opt} {_val}")(_eval_bad_option(_opt, _val))


@case("9", "eval --samples 4 with greedy decoding (temperature 0)")
def r9_eval_samples_greedy(c):
    r = c.cli(["eval", "--model", "tiny-llama", "--task", "arithmetic", "--size", "2", "--samples", "4"])
    return refused(r, ["--samples", "--temperature"])


@case("9", "eval --grader reference --task arithmetic")
def r9_eval_grader_arith(c):
    return refused(c.cli(["eval", "--model", "tiny-llama", "--task", "arithmetic", "--grader", "reference"]),
                   ["--grader"])


@case("9", "eval --protocol paper --task arithmetic")
def r9_eval_protocol_arith(c):
    return refused(c.cli(["eval", "--model", "tiny-llama", "--task", "arithmetic", "--protocol", "paper"]),
                   ["--protocol"])


@case("9", "eval --run RUN of a run that did not export")
def r9_eval_run_no_export(c):
    c.copy_run()
    c.sh("rm -rf run/export")
    return refused(c.cli(["eval", "--run", "run", "--size", "2"]), ["export"])


@case("9", "eval --run with --task of another task")
def r9_eval_run_other_task(c):
    c.copy_run()
    return refused(c.cli(["eval", "--run", "run", "--task", "math"]), ["--task", "arithmetic"])


@case("9", "eval --out a regular file")
def r9_eval_out_file(c):
    c.write("f", "x")
    r = c.cli(["eval", "--model", "tiny-llama", "--task", "arithmetic", "--size", "2", "--max-new-tokens", "2",
               "--out", "f"])
    return refused(r, ["f"])


@case("9", "serve-retriever --port 70000")
def r9_serve_port(c):
    return serve_refused(c, ["--index", str(FIX / "idx"), "--port", "70000"], ["--port"])


@case("9", "serve-retriever --host example.com")
def r9_serve_host(c):
    return serve_refused(c, ["--index", str(FIX / "idx"), "--host", "example.com", "--port", "0"], ["--host"])


@case("9", "serve-retriever --host 0.0.0.0 without --allow-remote")
def r9_serve_remote(c):
    return serve_refused(c, ["--index", str(FIX / "idx"), "--host", "0.0.0.0", "--port", "0"], ["--allow-remote"])


@case("9", "serve-retriever --index a folder that does not exist")
def r9_serve_index_missing(c):
    return serve_refused(c, ["--index", "nope", "--port", "0"], ["nope"])


@case("9", "serve-retriever --index a folder that is not an index")
def r9_serve_index_not(c):
    (c.dir / "d").mkdir()
    c.repro.append("mkdir d")
    return serve_refused(c, ["--index", "d", "--port", "0"], ["d"])


@case("9", "serve-retriever --max-topk 0")
def r9_serve_topk_zero(c):
    return serve_refused(c, ["--index", str(FIX / "idx"), "--port", "0", "--max-topk", "0"], ["--max-topk"])


@case("9", "serve-retriever --retriever dense on an index without a dense part")
def r9_serve_dense_missing(c):
    return serve_refused(c, ["--index", str(FIX / "idx"), "--port", "0", "--retriever", "dense"], ["dense"])


@case("9", "serve-retriever on a port already in use")
def r9_serve_port_busy(c):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    port = s.getsockname()[1]
    c.note(f"another process listens on 127.0.0.1:{port}")
    try:
        return serve_refused(c, ["--index", str(FIX / "idx"), "--port", str(port)], [str(port)])
    finally:
        s.close()


@case("9", "index build --corpus that does not exist")
def r9_index_corpus_missing(c):
    return refused(c.cli(["index", "build", "--corpus", "nope.jsonl", "--out", "idx"]), ["nope.jsonl"])


@case("9", "index build --fields '[1]'")
def r9_index_fields_list(c):
    return refused(c.cli(["index", "build", "--corpus", str(FIX / "corpus.jsonl"), "--out", "idx", "--fields", "[1]"]),
                   ["--fields"])


@case("9", "index build --fields naming a column the corpus lacks")
def r9_index_fields_missing(c):
    r = c.cli(["index", "build", "--corpus", str(FIX / "corpus.jsonl"), "--out", "idx", "--fields",
               '{"text": "body"}'])
    return refused(r, ["body"])


@case("9", "index build of a corpus with duplicate ids")
def r9_index_dup_ids(c):
    c.write("c.jsonl", jsonl([CORPUS[0], CORPUS[0]]))
    return refused(c.cli(["index", "build", "--corpus", "c.jsonl", "--out", "idx"]), ["duplicate"])


@case("9", "index build --out a regular file")
def r9_index_out_file(c):
    c.write("f", "x")
    r = c.cli(["index", "build", "--corpus", str(FIX / "corpus.jsonl"), "--out", "f"])
    if (c.dir / "f").read_text() != "x":
        return LOST, "the file was replaced"
    return refused(r, ["f"])


@case("9", "index dense --factory 'NoSuchFactory'")
def r9_index_factory_bad(c):
    c.sh(f"cp -r {FIX / 'idx'} idx")
    r = c.cli(["index", "dense", "--index", "idx", "--factory", "NoSuchFactory", "--device", "cpu"], timeout=180)
    return refused(r, ["factory", "NoSuchFactory"])


@case("9", "index dense --search-param nprobe=abc")
def r9_index_search_param(c):
    c.sh(f"cp -r {FIX / 'idx'} idx")
    return refused(c.cli(["index", "dense", "--index", "idx", "--search-param", "nprobe=abc"]), ["--search-param"])


@case("9", "kb make --out under a regular file")
def r9_kb_out_under_file(c):
    c.write("f", "x")
    return refused(c.cli(["kb", "make", "--out", "f/kb"]), ["f"])


@case("9", "train math with train_file and eval_file missing")
def r9_math_no_files(c):
    c.write("c.yaml", "extends: smoke\ntask: math\ntask_args: {}\n")
    return refused(c.cli(["train", "--config", "c.yaml", "--out", "run", *TINY]), ["train_file"])


@case("9", "train math whose train_file has fewer rows than eval_size")
def r9_math_small_train(c):
    c.write("train.jsonl", jsonl(MATH_ROWS))
    c.write("c.yaml", "extends: smoke\ntask: math\ntask_args: {train_file: train.jsonl}\n")
    return refused(c.cli(["train", "--config", "c.yaml", "--out", "run", *TINY]), ["eval_size"])


@case("9", "train search_qa with task_args.retriever_url=ftp://x")
def r9_retriever_url_bad(c):
    c.write("qa.jsonl", jsonl(QA_ROWS))
    c.write("c.yaml", "extends: smoke\ntask: search_qa\ntask_args: {train_file: qa.jsonl, eval_file: qa.jsonl, "
                      "retriever_url: 'ftp://x'}\n")
    return refused(c.cli(["train", "--config", "c.yaml", "--out", "run", *TINY]), ["retriever_url"])


@case("9", "train search_qa with task_args.index a folder that does not exist")
def r9_search_index_missing(c):
    c.write("qa.jsonl", jsonl(QA_ROWS))
    c.write("c.yaml", "extends: smoke\ntask: search_qa\ntask_args: {train_file: qa.jsonl, eval_file: qa.jsonl, "
                      "index: nope}\n")
    return refused(c.cli(["train", "--config", "c.yaml", "--out", "run", *TINY]), ["index", "nope"])


@case("9", "train with a prompt longer than the model's context (long_prompts=error): names the file and line")
def r9_long_prompt(c):
    rows = MATH_ROWS + [{"problem": "word " * 3000, "answer": "1"}]
    c.write("train.jsonl", jsonl(rows), show=False)
    c.note("train.jsonl = the 3 small math rows + a 4th row whose problem is 'word ' x 3000 (> 2048 tokens)")
    c.write("eval.jsonl", jsonl(MATH_ROWS))
    r = c.cli(["train", "--config", math_cfg(c), "--out", "run"])
    return refused(r, ["train.jsonl", "line 4"])


# =========================================================================================================
# Root 10 (new): special files where a file is expected: FIFOs, devices, directories, symlink loops, stdin

def _fifo(c, name):
    os.mkfifo(c.dir / name)
    c.repro.append(f"mkfifo {name}   # nobody writes to it")


def _link(c, name, target):
    os.symlink(target, c.dir / name)
    c.repro.append(f"ln -s {target} {name}")


@case("10", "`train --config FIFO` (a named pipe no one writes to)")
def r10_config_fifo_train(c):
    _fifo(c, "c.yaml")
    return refused(c.cli(["train", "--config", "c.yaml", "--out", "run"], timeout=T_SPECIAL), ["c.yaml"])


@case("10", "`plan --config FIFO`")
def r10_config_fifo_plan(c):
    _fifo(c, "c.yaml")
    return refused(c.cli(["plan", "--config", "c.yaml"], timeout=T_SPECIAL), ["c.yaml"])


@case("10", "`extends:` a FIFO")
def r10_extends_fifo(c):
    _fifo(c, "base.yaml")
    c.write("c.yaml", "extends: base\n")
    return refused(c.cli(["plan", "--config", "c.yaml"], timeout=T_SPECIAL), ["base.yaml"])


@case("10", "`train --config /dev/zero` (endless NUL bytes)")
def r10_config_devzero(c):
    return refused(c.cli(["train", "--config", "/dev/zero", "--out", "run"], timeout=T_SPECIAL), ["/dev/zero"])


@case("10", "`plan --config /dev/urandom` (endless random bytes)")
def r10_config_urandom(c):
    return refused(c.cli(["plan", "--config", "/dev/urandom"], timeout=T_SPECIAL), ["/dev/urandom"])


@case("10", "`train --config /dev/stdin` with stdin from /dev/null")
def r10_config_stdin_empty(c):
    return refused(c.cli(["train", "--config", "/dev/stdin", "--out", "run"], timeout=T_SPECIAL), ["/dev/stdin"])


@case("10", "`train --config /dev/stdin` with a config piped in (works like a file)")
def r10_config_stdin_pipe(c):
    c.repro.append("printf 'extends: smoke\\nsteps: 1\\n' | emapg train --config /dev/stdin ...  (see command)")
    r = subprocess.run([PY, "-m", "emapg", "train", "--config", "/dev/stdin", "--out", "run", *TINY, "steps=1"],
                       cwd=c.dir, env=ENV, input=b"model: tiny-llama\ntask: arithmetic\ntask_args: {digits: 1}\n",
                       capture_output=True, timeout=120, preexec_fn=_limits(AS_LIMIT, None))
    res = Result("", r.returncode, r.stdout.decode(), r.stderr.decode(), False, 0, 120)
    c.outputs.append(f"[exit {res.rc}]\n{res.tail()}")
    if res.rc == 0 and not has_tb(res):
        return HELD, "trained from the piped config"
    return refused(res, ["/dev/stdin"])


@case("10", "`compare --spec FIFO`")
def r10_spec_fifo(c):
    _fifo(c, "spec.yaml")
    return refused(c.cli(["compare", "--spec", "spec.yaml", "--out", "out"], timeout=T_SPECIAL), ["spec.yaml"])


@case("10", "`compare --spec /dev/zero`")
def r10_spec_devzero(c):
    return refused(c.cli(["compare", "--spec", "/dev/zero", "--out", "out"], timeout=T_SPECIAL), ["/dev/zero"])


@case("10", "compare spec whose `base:` is a FIFO")
def r10_spec_base_fifo(c):
    _fifo(c, "base.yaml")
    _spec(c, "base: base.yaml\n" + SPEC_OK)
    return refused(c.cli(["compare", "--spec", "spec.yaml", "--out", "out"], timeout=T_SPECIAL), ["base.yaml"])


@case("10", "`eval --data FIFO.jsonl`")
def r10_data_fifo_jsonl(c):
    _fifo(c, "d.jsonl")
    return refused(eval_math(c, "d.jsonl", timeout=T_SPECIAL), ["d.jsonl"])


@case("10", "`eval --data FIFO.json`")
def r10_data_fifo_json(c):
    _fifo(c, "d.json")
    return refused(eval_math(c, "d.json", timeout=T_SPECIAL), ["d.json"])


@case("10", "`eval --data FIFO.parquet`")
def r10_data_fifo_parquet(c):
    _fifo(c, "d.parquet")
    return refused(eval_math(c, "d.parquet", timeout=T_SPECIAL), ["d.parquet"])


@case("10", "math training with task_args.train_file a FIFO")
def r10_train_file_fifo(c):
    _fifo(c, "train.jsonl")
    c.write("eval.jsonl", jsonl(MATH_ROWS))
    return refused(c.cli(["train", "--config", math_cfg(c), "--out", "run"], timeout=T_SPECIAL), ["train.jsonl"])


@case("10", "`index build --corpus FIFO.jsonl`")
def r10_corpus_fifo(c):
    _fifo(c, "c.jsonl")
    return refused(c.cli(["index", "build", "--corpus", "c.jsonl", "--out", "idx"], timeout=T_SPECIAL), ["c.jsonl"])


@case("10", "`eval --data z.jsonl` where z.jsonl -> /dev/zero")
def r10_data_devzero_jsonl(c):
    _link(c, "z.jsonl", "/dev/zero")
    return refused(eval_math(c, "z.jsonl", timeout=T_SPECIAL), ["z.jsonl"])


@case("10", "`eval --data z.json` where z.json -> /dev/zero")
def r10_data_devzero_json(c):
    _link(c, "z.json", "/dev/zero")
    return refused(eval_math(c, "z.json", timeout=T_SPECIAL), ["z.json"])


@case("10", "`eval --data u.jsonl` where u.jsonl -> /dev/urandom")
def r10_data_urandom_jsonl(c):
    _link(c, "u.jsonl", "/dev/urandom")
    return refused(eval_math(c, "u.jsonl", timeout=T_SPECIAL), ["u.jsonl"])


@case("10", "`eval --data z.jsonl.gz` where z.jsonl.gz -> /dev/zero")
def r10_data_devzero_gz(c):
    _link(c, "z.jsonl.gz", "/dev/zero")
    return refused(eval_math(c, "z.jsonl.gz", timeout=T_SPECIAL), ["z.jsonl.gz"])


@case("10", "`index build --corpus z.jsonl` where z.jsonl -> /dev/zero")
def r10_corpus_devzero(c):
    _link(c, "z.jsonl", "/dev/zero")
    return refused(c.cli(["index", "build", "--corpus", "z.jsonl", "--out", "idx"], timeout=T_SPECIAL), ["z.jsonl"])


@case("10", "`eval --data d.jsonl` where d.jsonl is a directory")
def r10_data_dir_jsonl(c):
    (c.dir / "d.jsonl").mkdir()
    c.repro.append("mkdir d.jsonl")
    return refused(eval_math(c, "d.jsonl"), ["d.jsonl"])


@case("10", "`eval --data DIR` where DIR is a plain folder (not a datasets folder)")
def r10_data_plain_dir(c):
    c.write("d/x.txt", "x")
    return refused(eval_math(c, "d"), ["d"])


@case("10", "`eval --data loop.jsonl` (a symlink loop)")
def r10_data_symlink_loop(c):
    _link(c, "loop.jsonl", "loop.jsonl")
    return refused(eval_math(c, "loop.jsonl"), ["loop.jsonl"])


@case("10", "`plan --config loop.yaml` (a symlink loop)")
def r10_config_symlink_loop(c):
    _link(c, "loop.yaml", "loop.yaml")
    return refused(c.cli(["plan", "--config", "loop.yaml"]), ["loop.yaml"])


@case("10", "`train --out RUN` where RUN is a dangling symlink")
def r10_out_dangling(c):
    _link(c, "run", "nowhere/deeper")
    r = c.cli(["train", "--config", "smoke", "--out", "run", *TINY, "steps=1"])
    if r.rc == 0 and not has_tb(r):
        return HELD, "created the link's target and trained"
    return refused(r, ["run"])


@case("10", "`train --out FIFO`")
def r10_out_fifo(c):
    _fifo(c, "run")
    return refused(c.cli(["train", "--config", "smoke", "--out", "run", *TINY], timeout=T_SPECIAL), ["run"])


@case("10", "`train --resume RUN` whose config.yaml is a FIFO")
def r10_resume_config_fifo(c):
    c.copy_run()
    c.sh("rm run/config.yaml && mkfifo run/config.yaml")
    return refused(c.cli(["train", "--resume", "run", "steps=3"], timeout=T_SPECIAL), ["config.yaml"])


@case("10", "`train --resume RUN` whose metrics.jsonl -> /dev/zero")
def r10_resume_metrics_devzero(c):
    c.copy_run()
    c.sh("rm run/metrics.jsonl && ln -s /dev/zero run/metrics.jsonl")
    return refused(c.cli(["train", "--resume", "run", "steps=3"], timeout=T_SPECIAL), ["metrics.jsonl"])


@case("10", "`train --resume RUN` whose checkpoints/latest is a FIFO")
def r10_resume_latest_fifo(c):
    c.copy_run()
    c.sh("rm run/checkpoints/latest && mkfifo run/checkpoints/latest")
    r = c.cli(["train", "--resume", "run", "steps=3"], timeout=T_SPECIAL)
    if r.rc == 0 and not has_tb(r) and "latest" in r.text:
        return HELD, "named latest and resumed from the newest intact checkpoint"
    return refused(r, ["latest"])


@case("10", "`train --resume RUN` whose checkpoint state.json -> /dev/zero")
def r10_resume_state_devzero(c):
    c.copy_run()
    c.sh("rm run/checkpoints/step_000002/state.json && ln -s /dev/zero run/checkpoints/step_000002/state.json")
    r = c.cli(["train", "--resume", "run", "steps=3"], timeout=T_SPECIAL)
    if r.rc == 0 and not has_tb(r) and "state.json" in r.text:
        return HELD, "named it and resumed from step 1"
    return refused(r, ["state.json"])


@case("10", "`compare --report-only` where a run's eval.json is a FIFO")
def r10_compare_evaljson_fifo(c):
    _spec(c, f"base: {SMOKE}\n" + SPEC_OK)
    _fake_compare_out(c)
    c.sh("rm out/a/seed0/eval.json && mkfifo out/a/seed0/eval.json")
    return refused(c.cli(["compare", "--spec", "spec.yaml", "--out", "out", "--report-only"], timeout=T_SPECIAL),
                   ["eval.json"])


@case("10", "`eval --run RUN` whose config.yaml is a FIFO")
def r10_eval_run_config_fifo(c):
    c.copy_run()
    c.sh("rm run/config.yaml && mkfifo run/config.yaml")
    return refused(c.cli(["eval", "--run", "run", "--size", "2"], timeout=T_SPECIAL), ["config.yaml"])


@case("10", "`serve-retriever --index IDX` whose passages file is a FIFO")
def r10_serve_passages_fifo(c):
    c.sh(f"cp -r {FIX / 'idx'} idx")
    files = [p for p in (c.dir / "idx").iterdir() if p.name.startswith("passages")]
    c.sh(f"rm idx/{files[0].name} && mkfifo idx/{files[0].name}")
    return serve_refused(c, ["--index", "idx", "--port", "0"], [files[0].name], timeout=T_SPECIAL)


@case("10", "`eval --plugins FIFO.py`")
def r10_plugin_fifo(c):
    _fifo(c, "p.py")
    r = c.cli(["eval", "--plugins", "p.py", "--model", "tiny-llama", "--task", "arithmetic", "--size", "2"],
              timeout=T_SPECIAL)
    return refused(r, ["p.py"])


@case("10", "`index build --fields` … with --corpus a directory")
def r10_corpus_dir(c):
    (c.dir / "c.jsonl").mkdir()
    c.repro.append("mkdir c.jsonl")
    return refused(c.cli(["index", "build", "--corpus", "c.jsonl", "--out", "idx"]), ["c.jsonl"])


# =========================================================================================================
# Root S: the retrieval server under raw HTTP, and emapg's client against a bad server

_SERVER: dict = {}


def server_port() -> int:
    """Start `emapg serve-retriever` once (port 0), return its port."""
    if _SERVER.get("proc") and _SERVER["proc"].poll() is None:
        return _SERVER["port"]
    log = open(PROBE / "server.log", "wb")
    proc = subprocess.Popen([PY, "-m", "emapg", "serve-retriever", "--index", str(FIX / "idx"), "--port", "0"],
                            cwd=PROBE, env=ENV, stdout=log, stderr=log, preexec_fn=_limits(AS_LIMIT, None))
    t0 = time.monotonic()
    while time.monotonic() - t0 < 60:
        m = re.search(rb"http://127\.0\.0\.1:(\d+)/retrieve", (PROBE / "server.log").read_bytes())
        if m:
            _SERVER.update(proc=proc, port=int(m.group(1)))
            return _SERVER["port"]
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise RuntimeError("the retrieval server did not start: " + (PROBE / "server.log").read_text()[-2000:])


def stop_server():
    p = _SERVER.get("proc")
    if p and p.poll() is None:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            _killpg(p.pid)


def http_raw(data: bytes, timeout=10.0, port=None, drip=None) -> tuple[bytes, float]:
    """Send raw bytes, read until the server closes or `timeout` passes. Returns (answer, seconds)."""
    port = port or server_port()
    t0 = time.monotonic()
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        if drip:
            for i in range(len(data)):
                s.sendall(data[i:i + 1])
                time.sleep(drip)
        else:
            s.sendall(data)
        chunks = []
        s.settimeout(timeout)
        while True:
            try:
                b = s.recv(65536)
            except TimeoutError:
                break
            except ConnectionResetError:
                break
            if not b:
                break
            chunks.append(b)
            if b"\r\n\r\n" in b"".join(chunks):
                head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
                m = re.search(rb"content-length: *(\d+)", head, re.I)
                if m and len(body) >= int(m.group(1)):
                    break
        return b"".join(chunks), time.monotonic() - t0
    finally:
        s.close()


def post(body: bytes, extra_headers: bytes = b"", length: int | None = None) -> bytes:
    n = len(body) if length is None else length
    return (b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
            + str(n).encode() + b"\r\n" + extra_headers + b"\r\n" + body)


def status_of(ans: bytes) -> int | None:
    m = re.match(rb"HTTP/1\.[01] (\d{3})", ans)
    return int(m.group(1)) if m else None


def _http_case(c, request: bytes, want: set[int], must: str = "", timeout=15.0, show=None):
    c.repro.append(f"# start: emapg serve-retriever --index {FIX / 'idx'} --port 0   (port {server_port()})")
    c.repro.append(f"# send raw bytes: {(show or request)[:300]!r}")
    ans, secs = http_raw(request, timeout=timeout)
    c.outputs.append(f"[{secs:.1f} s] {ans[:600]!r}")
    st = status_of(ans)
    alive = _health_ok()
    if not alive:
        return HANG, "the server no longer answers GET /health"
    if st is None:
        return (HANG, f"no answer within {timeout:g} s") if secs >= timeout - 0.5 else \
            (UNCLEAR, f"the connection closed with no HTTP answer: {ans[:100]!r}")
    body = ans.partition(b"\r\n\r\n")[2]
    if st not in want:
        if st == 500:
            return UNCLEAR, f"HTTP 500 for the client's request (wanted {sorted(want)}): {body[:300]!r}"
        return WRONG, f"HTTP {st} (wanted {sorted(want)}): {body[:300]!r}"
    if st >= 400 and not body.lstrip().startswith(b"{"):
        return UNCLEAR, f"HTTP {st} without the JSON error form: {body[:200]!r}"
    if must and must.lower().encode() not in body.lower():
        return UNCLEAR, f"HTTP {st}; the error does not say {must!r}: {body[:300]!r}"
    return HELD, f"HTTP {st}: {body[:200]!r}"


def _health_ok(timeout=5.0) -> bool:
    try:
        ans, _ = http_raw(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", timeout=timeout)
        return status_of(ans) == 200
    except OSError:
        return False


@case("S", "POST /retrieve with malformed JSON")
def rs_malformed_json(c):
    return _http_case(c, post(b'{"queries": ["a"'), {400}, "JSON")


@case("S", "POST /retrieve with a non-UTF-8 body")
def rs_non_utf8(c):
    return _http_case(c, post(b'{"queries": ["caf\xe9"]}'), {400})


@case("S", "POST /retrieve with a lone surrogate in a query (\\ud83d)")
def rs_surrogate_query(c):
    return _http_case(c, post(b'{"queries": ["where \\ud83d is Paris"], "topk": 2}'), {200, 400})


@case("S", "POST /retrieve with queries [\"\"] (an empty query) and [\"   \"]")
def rs_empty_query(c):
    v = _http_case(c, post(b'{"queries": ["", "   "], "topk": 2}'), {200, 400})
    return v


@case("S", "POST /retrieve with a NUL character in a query")
def rs_nul_query(c):
    return _http_case(c, post(b'{"queries": ["Paris\\u0000capital"], "topk": 2}'), {200, 400})


@case("S", "POST /retrieve with topk 0, 10**30, true, 2.0, \"3\"")
def rs_topk_bad(c):
    for t in (b"0", b"1000000000000000000000000000000", b"true", b"2.0", b'"3"', b"-1", b"null"):
        v = _http_case(c, post(b'{"queries": ["Paris"], "topk": ' + t + b"}"), {400}, "topk")
        if v[0] != HELD:
            return v[0], f"topk {t.decode()}: {v[1]}"
    return HELD, "each refused with 400 naming topk"


@case("S", "POST /retrieve with 5,000 queries (over --max-queries 4096)")
def rs_too_many_queries(c):
    body = json.dumps({"queries": ["Paris"] * 5000}).encode()
    return _http_case(c, post(body), {400, 413}, "4096", show=b"{\"queries\": [\"Paris\" x 5000]}")


@case("S", "POST /retrieve with one 3,000-character query (over --max-query-chars 2048)")
def rs_long_query(c):
    body = json.dumps({"queries": ["a" * 3000]}).encode()
    return _http_case(c, post(body), {400}, "2048", show=b"{\"queries\": [\"a\" x 3000]}")


@case("S", "POST /retrieve declaring Content-Length 20 MB (over the 16 MiB limit), body never sent")
def rs_huge_length(c):
    return _http_case(c, post(b"", length=20_000_000), {413})


@case("S", "POST /retrieve sending a 17 MB body (over the limit) for real")
def rs_huge_body(c):
    body = b'{"queries": ["' + b"a" * 17_000_000 + b'"]}'
    return _http_case(c, post(body), {413}, timeout=30, show=b'{"queries": ["a" x 17,000,000]}')


@case("S", "POST /retrieve with JSON nested 100,000 deep")
def rs_deep_json(c):
    body = b"[" * 100000 + b"]" * 100000
    return _http_case(c, post(body), {400}, show=b"[ x 100000 + ] x 100000")


@case("S", "POST /retrieve with a 10,000-digit number for topk")
def rs_big_number(c):
    return _http_case(c, post(b'{"queries": ["a"], "topk": ' + b"9" * 10000 + b"}"), {400},
                      show=b'{"queries": ["a"], "topk": 9 x 10000}')


@case("S", "POST /retrieve with a chunked body")
def rs_chunked(c):
    req = (b"POST /retrieve HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"16\r\n{\"queries\": [\"Paris\"]}\r\n0\r\n\r\n")
    return _http_case(c, req, {411, 400})


@case("S", "POST /retrieve without Content-Length")
def rs_no_length(c):
    req = b"POST /retrieve HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n{\"queries\": [\"Paris\"]}"
    return _http_case(c, req, {411, 400})


@case("S", "POST /retrieve with Content-Length -1 / abc / two different values")
def rs_bad_length(c):
    for hdr in (b"Content-Length: -1\r\n", b"Content-Length: abc\r\n", b"Content-Length: 5\r\nContent-Length: 9\r\n"):
        req = b"POST /retrieve HTTP/1.1\r\nHost: x\r\n" + hdr + b"\r\n{\"queries\": [\"Paris\"]}"
        v = _http_case(c, req, {400})
        if v[0] != HELD:
            return v[0], f"{hdr!r}: {v[1]}"
    return HELD, "each refused with 400"


@case("S", "POST /retrieve whose body stops short of its Content-Length (the client then waits)")
def rs_short_body(c):
    return _http_case(c, post(b'{"queries": ["Par', length=100), {408, 400}, timeout=45)


@case("S", "GET /retrieve (wrong method) and POST /nope (unknown path)")
def rs_method_path(c):
    v = _http_case(c, b"GET /retrieve HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", {405})
    if v[0] != HELD:
        return v
    return _http_case(c, post(b'{"queries": ["a"]}').replace(b"/retrieve", b"/nope"), {404})


@case("S", "a request line of garbage")
def rs_garbage_request(c):
    return _http_case(c, b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03garbage\r\n\r\n", {400})


@case("S", "headers of 2 MB (one header line)")
def rs_huge_headers_2mb(c):
    req = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 2_000_000 + b"\r\n\r\n"
    return _http_case(c, req, {400, 431}, show=b"GET /health with a 2,000,000-byte header", timeout=30)


@case("S", "headers of 100 KB (within the server's bound, which refuses 2 MB)")
def rs_huge_headers(c):
    req = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n"
    return _http_case(c, req, {200, 400, 431}, show=b"GET /health with a 100,000-byte header")


@case("S", "body {\"queries\": [\"Paris\"], \"return_scores\": \"yes\"}")
def rs_return_scores(c):
    return _http_case(c, post(b'{"queries": ["Paris"], "return_scores": "yes"}'), {400}, "return_scores")


@case("S", "two requests pipelined on one connection both answered")
def rs_pipelined(c):
    one = post(b'{"queries": ["Paris"], "topk": 1}')
    c.repro.append(f"# send twice on one connection: {one!r}")
    ans, secs = http_raw(one + one, timeout=10)
    time.sleep(0.5)
    n = ans.count(b"HTTP/1.1 200")
    c.outputs.append(f"[{secs:.1f} s] {ans[:400]!r}")
    return (HELD, "both answered") if n == 2 else \
        (HELD if n == 1 else WRONG, f"{n} of 2 answered within 10 s (reading stops at the first full answer)")


@case("S", "slowloris: headers sent one byte per second; the connection is cut within ~10 s")
def rs_slowloris(c):
    port = server_port()
    c.repro.append(f"# emapg serve-retriever --index {FIX / 'idx'} --port 0  (port {port})")
    c.repro.append("# connect and send 'POST /retrieve HTTP/1.1\\r\\nHost: x\\r\\nX-a: ...' one byte per second")
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    t0 = time.monotonic()
    data = b"POST /retrieve HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
    closed_at = None
    try:
        for i in range(len(data)):
            try:
                s.sendall(data[i:i + 1])
                s.settimeout(1.0)
                try:
                    if s.recv(1024) == b"":
                        closed_at = time.monotonic() - t0
                        break
                except TimeoutError:
                    pass
            except (BrokenPipeError, ConnectionResetError):
                closed_at = time.monotonic() - t0
                break
            if time.monotonic() - t0 > 40:
                break
        healthy = _health_ok()
    finally:
        s.close()
    c.outputs.append(f"closed after {closed_at} s; /health ok meanwhile: {healthy}")
    if closed_at is None:
        return HANG, "a client dripping header bytes held its connection for 40 s"
    return HELD, f"cut after {closed_at:.1f} s; /health answered meanwhile: {healthy}"


@case("S", "slowloris x 60 connections at once: /health still answers")
def rs_slowloris_many(c):
    port = server_port()
    c.repro.append(f"# 60 connections each dripping one header byte per second to port {port}; then GET /health")
    socks = []
    for _ in range(60):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"POST /retrieve HTTP/1.1\r\n")
        socks.append(s)
    try:
        for _ in range(3):
            for s in socks:
                try:
                    s.sendall(b"X")
                except OSError:
                    pass
            time.sleep(1)
        t0 = time.monotonic()
        ok = _health_ok(timeout=5)
        secs = time.monotonic() - t0
    finally:
        for s in socks:
            s.close()
    return (HELD, f"/health answered in {secs:.2f} s") if ok else (HANG, "/health did not answer within 5 s")


@case("S", "1,200 idle connections (over limit_concurrency 1024): the server answers again once they go")
def rs_many_connections(c):
    port = server_port()
    c.repro.append(f"# open 1200 idle TCP connections to port {port}; GET /health during and 15 s after")
    socks = []
    try:
        for _ in range(1200):
            try:
                socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            except OSError:
                break
        time.sleep(1)
        try:
            ans, _ = http_raw(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", timeout=5)
            during = status_of(ans)
        except OSError as e:
            during = f"{type(e).__name__}"
        n = len(socks)
    finally:
        for s in socks:
            s.close()
    time.sleep(2)
    after = _health_ok(timeout=5)
    c.outputs.append(f"{n} connections open; /health during: {during}; after closing: {after}")
    if not after:
        time.sleep(15)
        after = _health_ok(timeout=5)
        if not after:
            return HANG, "the server did not answer /health after the idle connections closed"
    return HELD, f"{n} idle connections; /health during: {during}; after: ok"


@case("S", "50 concurrent valid requests all answered")
def rs_concurrent_valid(c):
    port = server_port()
    c.repro.append(f"# 50 threads each POST {{'queries': ['Paris'], 'topk': 2}} to port {port}")
    results = []

    def one():
        try:
            ans, _ = http_raw(post(b'{"queries": ["Paris capital"], "topk": 2}'), timeout=20, port=port)
            results.append(status_of(ans))
        except OSError as e:
            results.append(type(e).__name__)

    ts = [threading.Thread(target=one) for _ in range(50)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    ok = results.count(200)
    return (HELD, "50 of 50 answered 200") if ok == 50 else (WRONG, f"{ok} of 50 answered 200: {results}")


@case("S", "a client that sends half a body and disconnects: the server keeps serving")
def rs_disconnect_mid_body(c):
    port = server_port()
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(post(b'{"queries": ["Pa', length=200))
    s.close()
    c.repro.append("# send a POST with Content-Length 200 and 15 body bytes, then close")
    time.sleep(1)
    return (HELD, "/health ok") if _health_ok() else (HANG, "the server stopped answering")


@case("S", "POST /retrieve with topk 50 (the maximum) and return_scores true")
def rs_query_many_topk(c):
    return _http_case(c, post(b'{"queries": ["Paris"], "topk": 50, "return_scores": true}'), {200})


# ---- emapg's HTTP client (task_args.retriever_url) against a bad server

class _BadServer:
    """A TCP server in this process: 'drip' answers headers then one byte every 2 s; 'silent' never answers."""

    def __init__(self, mode: str):
        self.mode = mode
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        self.sock.settimeout(0.5)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn):
        try:
            conn.settimeout(5)
            try:
                conn.recv(65536)
            except OSError:
                pass
            if self.mode == "drip":
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
                while not self.stop.is_set():
                    conn.sendall(b" ")
                    time.sleep(2)
            else:
                while not self.stop.is_set():
                    time.sleep(0.5)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self):
        self.stop.set()
        self.sock.close()


@case("S", "emapg's retrieval client against a server that drips its answer (1 byte / 2 s): "
           "retriever_timeout bounds it?")
def rs_client_drip(c):
    srv = _BadServer("drip")
    c.note(f"a server on 127.0.0.1:{srv.port} answers 'HTTP/1.1 200 OK, Content-Length: 100000' and then one "
           "space every 2 s")
    try:
        r = c.py(f"""
            import time
            from emapg.retrieval import open_retriever
            r = open_retriever(url="http://127.0.0.1:{srv.port}", timeout=5.0)   # task_args.retriever_timeout: 5
            t = time.time()
            try:
                r.search(["Paris"], 3)
            except Exception as e:
                print("raised", type(e).__name__, str(e)[:200])
            print("after", round(time.time() - t, 1), "s")
        """, timeout=110)
    finally:
        srv.close()
    if r.timed_out:
        return HANG, ("search() had not returned after 110 s although the request timeout is 5 s "
                      "(urllib's timeout is per socket read; a byte every 2 s resets it)")
    return (HELD, r.out.strip()) if not has_tb(r) else (TB, tb_last(r))


@case("S", "emapg's retrieval client against a server that accepts and never answers (timeout 2 s)")
def rs_client_silent(c):
    srv = _BadServer("silent")
    c.note(f"a server on 127.0.0.1:{srv.port} accepts and never answers")
    try:
        r = c.py(f"""
            import time
            from emapg.retrieval import open_retriever
            r = open_retriever(url="http://127.0.0.1:{srv.port}", timeout=2.0)
            t = time.time()
            try:
                r.search(["Paris"], 3)
            except Exception as e:
                print("raised", type(e).__name__, str(e)[:300])
            print("after", round(time.time() - t, 1), "s")
        """, timeout=110)
    finally:
        srv.close()
    if r.timed_out:
        return HANG, "search() did not return within 110 s"
    if "raised" not in r.out:
        return WRONG, r.out.strip()
    return HELD, r.out.strip().replace("\n", " | ")


@case("S", "`eval --task search_qa` with retriever_url pointing at a port where nothing listens")
def rs_eval_no_server(c):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    c.write("qa.jsonl", jsonl(QA_ROWS))
    r = c.cli(["eval", "--model", "tiny-llama", "--task", "search_qa", "--task-args",
               json.dumps({"retriever_url": f"http://127.0.0.1:{port}", "response_prefix": "<search> Paris </search>"}),
               "--data", "qa.jsonl", "--size", "2", "--max-new-tokens", "4"], timeout=180)
    if r.rc == 0 and not has_tb(r):
        return HELD, "ran (no search was made, or it was handled)"
    return refused(r, [str(port)])


# =========================================================================================================
# Roots 11-17: issue 70's families (the third probe's 22 failures, each family tried more ways than it failed)

def _foreign_config(c, where="run"):
    """A finished run (copied) whose config.yaml names a plugin that leaves a marker when imported."""
    run, marker = _evil_run(c)
    if where != "run":
        c.sh(f"mv run {where}")
    return marker


def _refused_untrusted(c, r, marker) -> tuple[str, str]:
    if marker.exists():
        return WRONG, "a plugin named by a config inside a run folder ran without --trust-plugins"
    return refused(r, ["--trust-plugins"])


@case("11", "`plan --config RUN/config.yaml` whose config names a plugin (no --trust-plugins)")
def x11_plan_run_config(c):
    marker = _foreign_config(c)
    return _refused_untrusted(c, c.cli(["plan", "--config", "run/config.yaml", "--device", "cpu"]), marker)


@case("11", "`train --config RUN/config.yaml --out NEW` whose config names a plugin (no --trust-plugins)")
def x11_train_run_config(c):
    marker = _foreign_config(c)
    r = c.cli(["train", "--config", "run/config.yaml", "--out", "new", "steps=1"])
    v = _refused_untrusted(c, r, marker)
    if v[0] == HELD and (c.dir / "new").exists() and any((c.dir / "new").iterdir()):
        return WRONG, "refused, but the new run folder was written: " + err_line(r)
    return v


@case("11", "a compare spec whose `base:` is a run folder's config.yaml naming a plugin (no --trust-plugins)")
def x11_compare_base_run_config(c):
    marker = _foreign_config(c)
    _spec(c, "base: run/config.yaml\n" + SPEC_OK)
    return _refused_untrusted(c, c.cli(["compare", "--spec", "spec.yaml", "--out", "out"]), marker)


@case("11", "`plan --config mine.yaml` where mine.yaml `extends:` a run folder's config that names a plugin")
def x11_extends_run_config(c):
    marker = _foreign_config(c)
    c.write("mine.yaml", "extends: run/config.yaml\nsteps: 1\n")
    return _refused_untrusted(c, c.cli(["plan", "--config", "mine.yaml", "--device", "cpu"]), marker)


@case("11", "`plan --config OTHER/notes.yaml`: any file inside a folder emapg wrote a run into, naming a plugin")
def x11_file_in_run_folder(c):
    run = c.copy_run()
    marker = c.dir / "PWNED"
    c.write("evil.py", EVIL.format(marker=str(marker)))
    c.write("run/notes.yaml", f"extends: smoke\nplugins: [{c.dir / 'evil.py'}]\n")
    assert (run / ".emapg-run").exists()
    return _refused_untrusted(c, c.cli(["plan", "--config", "run/notes.yaml", "--device", "cpu"]), marker)


@case("11", "`plan --config RUN/config.yaml --trust-plugins`: the user's word imports the plugin, and it plans")
def x11_trusted_runs(c):
    marker = _foreign_config(c)
    r = c.cli(["plan", "--config", "run/config.yaml", "--device", "cpu", "--trust-plugins"])
    bad = succeeded(r)
    if bad:
        return bad
    return (HELD, "planned; the trusted plugin was imported") if marker.exists() else \
        (WRONG, "--trust-plugins given, yet the plugin was not imported")


@case("11", "`plan --config mine.yaml` naming a plugin the user wrote beside it: imported without a flag")
def x11_own_plugin_runs(c):
    marker = c.dir / "PWNED"
    c.write("mine.py", EVIL.format(marker=str(marker)))
    c.write("mine.yaml", f"extends: smoke\nplugins: [{c.dir / 'mine.py'}]\n")
    r = c.cli(["plan", "--config", "mine.yaml", "--device", "cpu"])
    bad = succeeded(r)
    if bad:
        return bad
    return (HELD, "planned with the user's own plugin") if marker.exists() else \
        (WRONG, "the user's own plugin was not imported")


def _huge_math_rows(c, megabytes: float, name="train.jsonl"):
    text = "1 + 1 = ? " * int(megabytes * 100_000)
    c.write(name, json.dumps({"problem": text, "answer": "2"}) + "\n" + jsonl(MATH_ROWS), show=False)
    c.note(f"{name}: row 1 a problem of {len(text):,} characters, then 3 small rows")
    c.write("eval.jsonl", jsonl(MATH_ROWS))


def _bounded(r, limit_s: float, must=()) -> tuple[str, str]:
    v = refused(r, must)
    if v[0] == HELD and r.seconds > limit_s:
        return HANG, f"refused, but after {r.seconds:.0f} s (more than {limit_s:g} s): {err_line(r)}"
    return v


@case("12", "train on a math file whose first problem is 50 MB: refused from its size, within seconds")
def x12_train_50mb(c):
    _huge_math_rows(c, 50)
    math_cfg(c)
    return _bounded(c.cli(["train", "--config", "math.yaml", "--out", "r"], timeout=120), 60, ["train.jsonl",
                                                                                             "line 1"])


@case("12", "train on a math file whose first problem is 1 MB (it took 14 s to refuse)")
def x12_train_1mb(c):
    _huge_math_rows(c, 1)
    math_cfg(c)
    return _bounded(c.cli(["train", "--config", "math.yaml", "--out", "r"], timeout=120), 30, ["line 1"])


@case("12", "train with `long_prompts: truncate` on a 20 MB first problem: the row is cut, the run trains")
def x12_train_truncate(c):
    _huge_math_rows(c, 20)
    cfg = math_cfg(c)
    c.sh(f"echo 'long_prompts: truncate' >> {cfg}")
    r = c.cli(["train", "--config", cfg, "--out", "r"], timeout=180)
    bad = succeeded(r)
    if bad:
        return bad
    return (HELD, f"trained in {r.seconds:.0f} s with the row cut") if r.seconds < 150 else \
        (HANG, f"trained, but took {r.seconds:.0f} s")


@case("12", "`eval` of a math file whose first problem is 50 MB")
def x12_eval_50mb(c):
    _huge_math_rows(c, 50, "set.jsonl")
    return _bounded(eval_math(c, "set.jsonl", timeout=120), 60, ["set.jsonl", "line 1"])


@case("12", "the retrieval server given one 5 MB query")
def x12_server_huge_query(c):
    body = json.dumps({"queries": ["paris " * 900_000], "topk": 2}).encode()
    return _http_case(c, post(body), {400, 413}, must="queries", show=b"POST /retrieve (a 5.4 MB query)")


@case("13", "`train --resume B` whose checkpoints/ is a symlink to run A's: refused, A untouched")
def x13_checkpoints_linked(c):
    a = c.copy_run("a")
    c.copy_run("b")
    c.sh("rm -rf b/checkpoints && ln -s ../a/checkpoints b/checkpoints")
    before = digest(a)
    r = c.cli(["train", "--resume", "b", "steps=4"])
    lost = changed(before, digest(a))
    if lost:
        return LOST, f"run a changed through b's link: {lost[:5]}"
    return refused(r, ["out of the run folder"])


@case("13", "`train --resume B` whose step_2 is a symlink to run A's step_2: not resumed from, not pruned")
def x13_step_linked(c):
    a = c.copy_run("a")
    c.copy_run("b")
    c.sh("rm -rf b/checkpoints/step_000002 && ln -s ../../a/checkpoints/step_000002 b/checkpoints/step_000002")
    before = digest(a)
    r = c.cli(["train", "--resume", "b", "steps=3", "keep_checkpoints=1"])
    lost = changed(before, digest(a))
    if lost:
        return LOST, f"run a changed through b's link: {lost[:5]}"
    bad = succeeded(r)
    if bad:
        return bad
    if "out of the run folder" not in r.text:
        return WRONG, "resumed beside another run's linked checkpoint without a word"
    return HELD, "resumed from its own step 1, the link named: " + err_line(r)


@case("13", "checkpoints/latest repointed (by hand) to another run's step folder")
def x13_latest_elsewhere(c):
    a = c.copy_run("a")
    c.copy_run("b")
    c.sh("""printf '{"checkpoint": "../../a/checkpoints/step_000002", "step": 2}' > b/checkpoints/latest""")
    before = digest(a)
    r = c.cli(["train", "--resume", "b", "steps=3", "keep_checkpoints=1"])
    lost = changed(before, digest(a))
    if lost:
        return LOST, f"run a changed: {lost[:5]}"
    if r.rc == 0 and not has_tb(r):
        return (HELD, "resumed from its own checkpoints: " + err_line(r)) if "latest" in r.text.lower() else \
            (WRONG, "resumed without saying that latest pointed elsewhere")
    return refused(r, ["latest"])


@case("13", "`export RUN --out RUN/checkpoints/step_2/mine`: an export the next prune would delete")
def x13_export_into_checkpoints(c):
    c.copy_run()
    r = c.cli(["export", "run", "--out", "run/checkpoints/step_000002/mine"])
    return refused(r, ["checkpoints"])


@case("13", "checkpoints/latest is a folder")
def x13_latest_folder(c):
    return _damaged_resume(c, "checkpoints/latest", "DIR", name="latest")


def _damaged_optimizer(c, damage, said: str, must: str) -> Result:
    """Resume a copied run whose step-2 state.json's optimizer ``damage`` changed (``said``: how): the older
    checkpoint resumes, naming the damaged file (and ``must``)."""
    run = c.copy_run()
    state = run / "checkpoints/step_000002/state.json"
    data = json.loads(state.read_text())
    damage(data["optimizer"])
    c.write("run/checkpoints/step_000002/state.json", json.dumps(data), show=False)
    c.note(f"run/checkpoints/step_000002/state.json: {said}")
    r = c.cli(["train", "--resume", "run", "steps=3"])
    bad = succeeded(r)
    if bad:
        return bad
    return (HELD, err_line(r)) if must in r.text and "step 1" in r.text else \
        (WRONG, "resumed without naming the damaged state.json: " + err_line(r))


@case("14", "state.json's optimizer has empty param_groups: the older checkpoint resumes, said")
def x14_empty_param_groups(c):
    return _damaged_optimizer(c, lambda o: o.update(param_groups=[]), "optimizer.param_groups = []", "state.json")


@case("14", "metrics.jsonl with a stray 0xff byte: named on resume, not rewritten")
def x14_metrics_stray_byte(c):
    run = c.copy_run()
    raw = (run / "metrics.jsonl").read_bytes()
    lines = raw.split(b"\n")
    lines[0] = lines[0][:-1] + b', "x": "\xff"}'
    c.write("run/metrics.jsonl", b"\n".join(lines))
    before = (run / "metrics.jsonl").read_bytes()
    r = c.cli(["train", "--resume", "run", "steps=3"])
    after = (run / "metrics.jsonl").read_bytes()
    if b"\xef\xbf\xbd" in after or (b"\xff" not in after):
        return WRONG, "metrics.jsonl was rewritten, its stray byte replaced"
    if r.rc == 0 and after != before and not has_tb(r):
        return WRONG, "resumed and appended to a damaged metrics.jsonl without a word"
    return refused(r, ["metrics.jsonl", "line 1"])


@case("14", "`plan` of a model folder whose config.json is `null`")
def x14_plan_config_null(c):
    c.write("m/config.json", "null")
    return refused(c.cli(["plan", "--config", "smoke", f"model={c.dir / 'm'}", "--device", "cpu"]),
                   ["config.json"])


@case("14", "`plan` of a model folder whose config.json is a list, then a string")
def x14_plan_config_list(c):
    c.write("m/config.json", "[1, 2]")
    v = refused(c.cli(["plan", "--config", "smoke", f"model={c.dir / 'm'}", "--device", "cpu"]), ["config.json"])
    if v[0] != HELD:
        return v
    c.write("m/config.json", '"llama"')
    return refused(c.cli(["plan", "--config", "smoke", f"model={c.dir / 'm'}", "--device", "cpu"]),
                   ["config.json"])


def _plan_shape(c, **over) -> Result:
    base = json.loads((SRC.parent / "tests/fixtures/model_configs/deepseek-r1-distill-qwen-7b/config.json")
                      .read_text())
    c.write("m/config.json", json.dumps({**base, **over}))
    return c.cli(["plan", "--config", "smoke", f"model={c.dir / 'm'}", "--device", "cpu"], timeout=180)


@case("15", "`plan` of a config.json with hidden_size 10^6 (terabytes a layer)")
def x15_plan_wide(c):
    r = _plan_shape(c, hidden_size=28 * 36_000, intermediate_size=10**6)  # heads divide it: the width is the test
    if r.rc == 0 and not has_tb(r):
        return HELD, "planned (measured at a bounded width): " + r.out.strip().splitlines()[-1][:200]
    return _bounded(r, 120)


@case("15", "`plan` of a config.json with 10^9 layers")
def x15_plan_deep(c):
    r = _plan_shape(c, num_hidden_layers=10**9)
    if r.rc == 0 and not has_tb(r):
        return HELD, "planned: " + r.out.strip().splitlines()[-1][:200]
    return _bounded(r, 120)


@case("15", "`plan` of a config.json with hidden_size 0, then -5")
def x15_plan_nonpositive(c):
    v = refused(_plan_shape(c, hidden_size=0), ["hidden_size"])
    if v[0] != HELD:
        return v
    return refused(_plan_shape(c, hidden_size=-5), ["hidden_size"])


@case("16", "a config giving `lr` twice at the top level")
def x16_duplicate_top_key(c):
    c.write("c.yaml", "extends: smoke\nlr: 1.0e-3\nsteps: 2\nlr: 5.0e-5\n")
    return refused(c.cli(["train", "--config", "c.yaml", "--out", "r"]), ["lr", "line 2", "line 4"])


@case("16", "a config giving `algo.eta` twice inside a nested block")
def x16_duplicate_nested_key(c):
    c.write("c.yaml", "extends: smoke\nalgo:\n  eta: 0.9\n  beta: 0.05\n  eta: 0.5\n")
    return refused(c.cli(["train", "--config", "c.yaml", "--out", "r"]), ["eta", "line 3", "line 5"])


@case("16", "two `index build --out SAME` at once: one builds, the other is refused")
def x16_index_two_writers(c):
    c.write("corpus.jsonl", jsonl([{"id": str(i), "title": f"t{i}", "text": f"word{i} " * 2000}
                                   for i in range(3000)]), show=False)
    c.note("corpus.jsonl: 3000 passages of 2000 words (a build that takes a few seconds)")
    p1 = c.popen(["index", "build", "--corpus", "corpus.jsonl", "--out", "ix"])
    time.sleep(1.5)
    r2 = c.cli(["index", "build", "--corpus", "corpus.jsonl", "--out", "ix"])
    out1, err1 = p1.communicate(timeout=300)
    c.outputs.append(f"[first build exit {p1.returncode}] {err1.decode()[-400:]}")
    if p1.returncode == 0 and r2.rc == 0:
        return WRONG, "both builds said they succeeded (the last rename won)"
    if p1.returncode != 0 and r2.rc != 0:
        return UNCLEAR, "neither build succeeded: " + err_line(r2)
    loser = r2 if r2.rc != 0 else None
    if loser is None:
        return HELD, "the second started after the first finished (the first was refused?)"
    return refused(loser, ["PID"])


@case("16", "the default (lenient) grader: an identical boxed answer and gold of 4,500 digits")
def x16_grader_huge_gold(c):
    r = c.py("""
        from emapg.rewards.math import math_reward
        gold = "7" * 4500
        print(math_reward("so \\\\boxed{" + gold + "}", gold), math_reward("so \\\\boxed{" + gold + "8}", gold))
    """, timeout=60)
    if has_tb(r) or r.timed_out:
        return refused(r)
    return (HELD, r.out.strip()) if r.out.split() == ["1.0", "0.0"] else (WRONG, f"scores {r.out.strip()}")


@case("16", "the retrieval server given a query holding a lone surrogate (JSON \\ud800)")
def x16_server_surrogate(c):
    return _http_case(c, post(b'{"queries": ["paris \\ud800"], "topk": 2}'), {400}, must="surrogate")


@case("16", "a bad value set in a parent config, trained through the child that extends it")
def x16_blame_parent(c):
    c.write("parent.yaml", "extends: smoke\nlr: -1\n")
    c.write("child.yaml", "extends: parent\nsteps: 2\n")
    r = c.cli(["train", "--config", "child.yaml", "--out", "r"])
    v = refused(r, ["parent.yaml", "lr"])
    if v[0] == HELD and "child.yaml: lr" in r.text:
        return UNCLEAR, "blamed on the child: " + err_line(r)
    return v


@case("16", "a compare spec with `configs: {}`, then one with `seeds: []`")
def x16_spec_runs_nothing(c):
    _spec(c, f"base: {SMOKE}\nseeds: [0]\nconfigs: {{}}\n")
    v = refused(c.cli(["compare", "--spec", "spec.yaml", "--out", "out"]), ["configs"])
    if v[0] != HELD:
        return v
    _spec(c, f"base: {SMOKE}\nseeds: []\nconfigs: {{a: []}}\n")
    return refused(c.cli(["compare", "--spec", "spec.yaml", "--out", "out2"]), ["seeds"])


@case("16", "`compare --report-only` on an empty --out")
def x16_report_empty_out(c):
    _spec(c, f"base: {SMOKE}\n" + SPEC_OK)
    c.sh("mkdir out")
    r = c.cli(["compare", "--spec", "spec.yaml", "--out", "out", "--report-only"])
    v = refused(r, ["finished"])
    return (WRONG, "exit 0, reporting nothing") if v[0] == WRONG else v


@case("16", "a config file named results.md (the name of a report file) given to `compare` as its base")
def x16_config_named_like_report(c):
    c.write("results.md", f"extends: {SMOKE}\nsteps: 1\neval: {{size: 2}}\nexport: false\n")
    _spec(c, "base: results.md\nseeds: [0]\noverrides: [steps=1]\nconfigs: {a: []}\n")
    r = c.cli(["compare", "--spec", "spec.yaml", "--out", "."], timeout=300)
    if r.rc == 0 and not has_tb(r):
        return (HELD, "ran; the config kept") if "steps: 1" in (c.dir / "results.md").read_text() else \
            (LOST, "the report overwrote the config file results.md")
    return refused(r, ["results.md"])


@case("16", "`eval --size 1` of a file whose second row is too long: the first row is evaluated")
def x16_eval_unread_long_row(c):
    c.write("set.jsonl", jsonl([MATH_ROWS[0], {"problem": "long " * 3000, "answer": "3"}]), show=False)
    r = eval_math(c, "set.jsonl", "--size", "1")
    if "long_prompts" in r.text:
        return UNCLEAR, "advises long_prompts, which eval does not have: " + err_line(r)
    return succeeded(r) or (HELD, "evaluated the first row")


@case("16", "`eval --size 2` of that file: refused naming line 2, advising what eval can do")
def x16_eval_long_row_advice(c):
    c.write("set.jsonl", jsonl([MATH_ROWS[0], {"problem": "long " * 3000, "answer": "3"}]), show=False)
    r = eval_math(c, "set.jsonl", "--size", "2")
    if "long_prompts" in r.text:
        return UNCLEAR, "advises long_prompts, which eval does not have: " + err_line(r)
    return refused(r, ["line 2"])


@case("16", "a search eval row whose `answers` is null")
def x16_qa_answers_null(c):
    c.write("qa.jsonl", jsonl([{"question": "who?", "answers": None}, QA_ROWS[0]]))
    r = eval_qa(c, "qa.jsonl")
    v = refused(r, ["answers", "null"])
    return (UNCLEAR, "calls a null answer missing: " + err_line(r)) if v[0] == UNCLEAR and "missing" in r.text \
        else v


_BAD_TASKS = '''
from emapg.tasks import Task, register_task


class Undefined(Task):
    def __init__(self, size: "NoSuchType" = 2):
        self.size = size


class Stringy(Task):
    def __init__(self):
        pass

    def train_examples(self, rng, n):
        return "not a list"

    def eval_examples(self, n):
        return []

    def reward(self, completion, example):
        return 0.0


register_task("undefined", Undefined)
register_task("stringy", Stringy)
'''


@case("16", "a plugin task whose __init__ annotations name an undefined type")
def x16_plugin_bad_annotation(c):
    c.write("bad_tasks.py", _BAD_TASKS)
    c.write("c.yaml", f"extends: smoke\nplugins: [{c.dir / 'bad_tasks.py'}]\ntask: undefined\n")
    return refused(c.cli(["train", "--config", "c.yaml", "--out", "r"]), ["undefined", "bad_tasks.py"])


@case("16", "a plugin task whose train_examples returns a string")
def x16_plugin_train_examples_string(c):
    c.write("bad_tasks.py", _BAD_TASKS)
    c.write("c.yaml", f"extends: smoke\nplugins: [{c.dir / 'bad_tasks.py'}]\ntask: stringy\neval: {{size: 0}}\n")
    return refused(c.cli(["train", "--config", "c.yaml", "--out", "r"]), ["stringy", "train_examples"])


@case("11", "`train --resume COPY` of a run copied without its hidden marker, whose config names a plugin")
def x11_resume_copy_without_marker(c):
    _foreign_config(c)
    c.sh("mkdir copy && cp -r run/* copy/")
    marker = c.dir / "PWNED"
    return _refused_untrusted(c, c.cli(["train", "--resume", "copy", "steps=3"]), marker)


@case("11", "a compare spec inside a run folder whose overrides name a plugin (no --trust-plugins)")
def x11_spec_in_run_folder(c):
    run = c.copy_run()
    marker = c.dir / "PWNED"
    c.write("evil.py", EVIL.format(marker=str(marker)))
    c.write("run/spec.yaml", f"base: {SMOKE}\nseeds: [0]\nconfigs: {{a: ['plugins=[{c.dir / 'evil.py'}]']}}\n")
    assert (run / ".emapg-run").exists()
    return _refused_untrusted(c, c.cli(["compare", "--spec", "run/spec.yaml", "--out", "out"]), marker)


@case("11", "another run (naming a plugin) copied into a compare's --out as one of its runs, unfinished")
def x11_compare_foreign_run_in_out(c):
    _foreign_config(c)
    c.sh("mkdir -p out/a && cp -r run out/a/seed0 && rm -f out/a/seed0/eval.json out/a/seed0/finished.json")
    marker = c.dir / "PWNED"
    _spec(c, f"base: {SMOKE}\n" + SPEC_OK)
    r = c.cli(["compare", "--spec", "spec.yaml", "--out", "out"], timeout=300)
    if marker.exists():
        return WRONG, "compare resumed another run with its plugin (it added --trust-plugins itself)"
    return refused(r, ["not the spec's"])


@case("16", "a finished run with other settings copied into a compare's --out: reported as the spec's?")
def x16_compare_stale_run(c):
    c.copy_run("keep")
    c.sh("mkdir -p out/a && cp -r keep out/a/seed0")
    _spec(c, f"base: {SMOKE}\nseeds: [0]\noverrides: [steps=2]\nconfigs: {{a: [algo.eta=0.5, lr=0.25]}}\n")
    return refused(c.cli(["compare", "--spec", "spec.yaml", "--out", "out"]), ["not the spec's", "lr"])


@case("13", "`train --resume B` whose export/, outcomes/ or tensorboard/ is a link to run A's")
def x13_run_entries_linked(c):
    a = c.copy_run("a")
    c.copy_run("b")
    before = digest(a)
    for name in ("export", "outcomes", "tensorboard"):
        c.sh(f"rm -rf b/{name} && ln -s ../a/{name} b/{name}")
        r = c.cli(["train", "--resume", "b", "steps=3"])
        lost = changed(before, digest(a))
        if lost:
            return LOST, f"run a changed through b's {name} link: {lost[:5]}"
        v = refused(r, [name, "out of the run folder"])
        if v[0] != HELD:
            return v
        c.sh(f"rm b/{name}")
    return HELD, "each link refused, run a untouched"


@case("13", "`export B --out A/export` and `--out A/checkpoints/step_2/x`: into another run's folder")
def x13_export_into_other_run(c):
    a = c.copy_run("a")
    c.copy_run("b")
    before = digest(a)
    for out in ("a/export", "a/checkpoints/step_000002/x"):
        r = c.cli(["export", "b", "--out", out])
        lost = changed(before, digest(a))
        if lost:
            return LOST, f"run a changed: {lost[:5]}"
        v = refused(r, ["another run"])
        if v[0] != HELD:
            return v
    return HELD, "both refused, run a untouched"


@case("13", "`export B --step 2` whose step_2 is a link to run A's")
def x13_export_step_linked(c):
    c.copy_run("a")
    c.copy_run("b")
    c.sh("rm -rf b/checkpoints/step_000002 && ln -s ../../a/checkpoints/step_000002 b/checkpoints/step_000002")
    r = c.cli(["export", "b", "--step", "2", "--out", "e"])
    if r.rc == 0:
        return WRONG, "exported run a's weights as b's"
    return refused(r, ["out of the run folder"])


@case("14", "outcomes/outcomes.jsonl with a stray byte, then a row whose step is 'x': resume names them")
def x14_outcomes_damaged(c):
    run = c.copy_run()
    path = run / "outcomes/outcomes.jsonl"
    good = path.read_bytes()
    for bad in (b'{"step": 1, "x": "\xff"}\n', b'{"step": "x"}\n'):
        c.write("run/outcomes/outcomes.jsonl", bad + good)
        v = refused(c.cli(["train", "--resume", "run", "steps=3"]), ["outcomes.jsonl", "line 1"])
        if v[0] != HELD:
            return v
        if path.read_bytes() != bad + good:
            return WRONG, "outcomes.jsonl was rewritten"
    return HELD, "both named, the file unchanged"


@case("16", "a config with a number as a key (`1: a`)")
def x16_numeric_key(c):
    c.write("c.yaml", "extends: smoke\n1: a\n")
    return refused(c.cli(["train", "--config", "c.yaml", "--out", "r"]), ["line 2"])


# Issue 70's independent re-probe (studies/probe56/reprobe70): the 10 cases it found not held after the fixes
# above, each added here as it was tried there.

@case("11", "a config at the top of a compare's --out (a folder emapg wrote runs into) naming a plugin: `plan`")
def x11_config_in_compare_out(c):
    marker = _foreign_config(c)
    _spec(c, f"base: {SMOKE}\n" + SPEC_OK)
    bad = succeeded(c.cli(["compare", "--spec", "spec.yaml", "--out", "out"], timeout=300))
    if bad:
        return UNCLEAR, "the probe could not set the case up: " + bad[1]
    c.sh("cp run/config.yaml out/theirs.yaml")
    return _refused_untrusted(c, c.cli(["plan", "--config", "out/theirs.yaml", "--device", "cpu"]), marker)


@case("16", "the lenient grader on a 4,800-digit answer written otherwise than its gold (unboxed, N.0, N/1)")
def x16_grader_huge_forms(c):
    r = c.py("""
        from emapg.rewards.math import math_reward
        gold = "12345678" * 600
        print(math_reward("So the answer is " + gold, gold), math_reward("\\\\boxed{" + gold + "}", gold + ".0"),
              math_reward("\\\\boxed{\\\\frac{" + gold + "}{1}}", gold),
              math_reward("So it is " + gold[:-1] + "9", gold))
    """, timeout=120)
    if has_tb(r) or r.timed_out:
        return refused(r)
    return ((HELD, r.out.strip()) if r.out.split() == ["1.0", "1.0", "1.0", "0.0"] else
            (WRONG, f"scores {r.out.strip()}"))


@case("12", "`index dense` over a corpus holding one 50 MB passage: encoded from its head, not tokenized whole")
def x12_index_dense_50mb(c):
    rows = [{"id": str(i), "title": f"t{i}", "text": f"passage {i} about rivers"} for i in range(5)]
    rows.append({"id": "big", "title": "big", "text": "the castle stands on a hill above the river. " * 1_100_000})
    c.write("corpus.jsonl", jsonl(rows), show=False)
    c.note("corpus.jsonl: 5 small passages and one of 50 MB")
    bad = succeeded(c.cli(["index", "build", "--corpus", "corpus.jsonl", "--out", "idx"], timeout=180))
    if bad:
        return UNCLEAR, "the probe could not set the case up: " + bad[1]
    r = c.cli(["index", "dense", "--index", "idx", "--device", "cpu"], timeout=300)
    return succeeded(r) or (HELD, f"encoded in {r.seconds:.0f} s: {err_line(r)}")


@case("14", "state.json's optimizer names a parameter the model has not: the older checkpoint resumes, said")
def x14_optimizer_foreign_param(c):
    return _damaged_optimizer(c, lambda o: o["param_groups"][0]["params"].__setitem__(0, "no.such.param"),
                              "optimizer.param_groups[0].params[0] = 'no.such.param'", "no.such.param")


@case("15", "`plan` of a tiny llama's config.json with hidden_size 10^6 and head_dim 16 (measured whole)")
def x15_plan_wide_head_dim(c):
    r = c.py("""
        import json
        from emapg.models.zoo import tiny_model
        print(json.dumps({**tiny_model().config.to_dict(), "hidden_size": 10**6, "head_dim": 16}))
    """, log=False)
    c.write("m/config.json", r.out)
    r = c.cli(["plan", "--config", "smoke", f"model={c.dir / 'm'}", "--device", "cpu"], timeout=300)
    if r.rc == 0 and not has_tb(r):
        return HELD, "planned: " + r.out.strip().splitlines()[-1][:200]
    return refused(r, ["hidden_size 1000000"])


@case("16", "a config using a YAML merge key (`algo: {<<: *b, beta: 0.5}`)")
def x16_yaml_merge_key(c):
    c.write("c.yaml", "extends: smoke\nb: &b {eta: 0.9}\nalgo: {<<: *b, beta: 0.5}\n")
    return refused(c.cli(["train", "--config", "c.yaml", "--out", "r"]), ["merge key", "line 3"])


@case("16", "a plugin task with an unresolvable annotation chosen by the override task=undefined: blamed on it")
def x16_plugin_annotation_override(c):
    c.write("bad_tasks.py", _BAD_TASKS)
    r = c.cli(["train", "--config", "smoke", "--out", "r", f"plugins=[{c.dir / 'bad_tasks.py'}]", "task=undefined"])
    return refused(r, ["override task=undefined", "bad_tasks.py"])


def _kill_during_nproc(c, target: str):
    """`train --nproc 2` killed (SIGKILL) once it saved a checkpoint: ``target`` "torchrun" (the launcher, child
    of emapg train), "rank 0" (a worker, as the out-of-memory killer would) or "emapg" (the user's emapg train)."""
    p = c.popen(["train", "--nproc", "2", "--config", "smoke", "--out", "run", "steps=200", "eval.size=0",
                 "threads=1", "save_every=1", "export=false"])
    end = time.monotonic() + 180
    while not (c.dir / "run/checkpoints/latest").exists():
        if p.poll() is not None or time.monotonic() > end:
            _killpg(p.pid)
            return UNCLEAR, "the run never saved a checkpoint (the probe could not set the case up)"
        time.sleep(0.2)
    (launcher,) = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
    workers = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    rank0 = next(w for w in workers if b"\0RANK=0\0" in b"\0" + Path(f"/proc/{w}/environ").read_bytes())
    victim = int({"torchrun": launcher, "rank 0": rank0}.get(target, p.pid))
    c.note(f"kill -9 {victim}   # {target}")
    os.kill(victim, signal.SIGKILL)
    try:
        _, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        _killpg(p.pid)
        return HANG, "the workers or the launcher did not end within 120 s"
    err = err.decode("utf-8", "replace")
    c.outputs.append(f"[exit {p.returncode}] {err[-800:]}")
    time.sleep(2)
    left = [w for w in [*workers, launcher] if Path(f"/proc/{w}").exists()]
    if left:
        for w in left:
            _killpg(int(w))
        return UNCLEAR, f"processes {left} outlived the kill"
    if "Traceback (most recent call last)" in err:
        return UNCLEAR, "a traceback is what is said last: " + err.strip().splitlines()[-1][:200]
    if "--resume run --nproc 2" not in err:
        return UNCLEAR, "no resume line with --nproc 2: " + (err.strip().splitlines() or ["nothing"])[-1][:200]
    return HELD, [ln for ln in err.splitlines() if ln.startswith("emapg: ") and "--nproc 2" in ln][-1][:300]


@case("17", "`train --nproc 2` whose torchrun launcher is killed by SIGKILL: said, with how to resume")
def x17_launcher_sigkill(c):
    return _kill_during_nproc(c, "torchrun")


@case("17", "`train --nproc 2` whose rank-0 worker is killed by SIGKILL: said, with how to resume")
def x17_worker_sigkill(c):
    return _kill_during_nproc(c, "rank 0")


@case("17", "`train --nproc 2` whose own emapg train process is killed by SIGKILL: said, with how to resume")
def x17_emapg_sigkill(c):
    return _kill_during_nproc(c, "emapg")


# =========================================================================================================
# runner and report

ROOT_NAMES = {
    "1": "writer's lock and its children", "2": "changes before knowing it can run",
    "3": "files read back trusted by shape", "4": "bad text in data rows", "5": "shared folders running code",
    "6": "unbounded work on model output", "7": "grading edge cases", "8": "plan vs train",
    "9": "messages: what and where", "10": "special files (FIFO, devices, dirs, loops, stdin)",
    "S": "retrieval server and client under raw HTTP",
    "11": "plugins named by a run folder's config, on every path", "12": "unbounded reads before a bound",
    "13": "symlinks out of a run folder", "14": "files read back, checked by what they hold",
    "15": "the plan allocating what it describes", "16": "silent wrong and unclear messages",
    "17": "the torchrun launcher killed",
}


def run_case(name, root, title, fn) -> dict:
    c = Ctx(name)
    t0 = time.monotonic()
    try:
        verdict = fn(c)
        cls, detail = verdict if isinstance(verdict, tuple) else (PROBE_ERR, repr(verdict))
    except Exception as e:  # the probe's own failure: not a finding
        cls, detail = PROBE_ERR, f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
    for f in c.cleanup:
        f()
    return {"id": name, "root": root, "root_name": ROOT_NAMES.get(root, root), "title": title, "class": cls,
            "detail": str(detail), "repro": c.repro, "output": c.outputs, "seconds": round(time.monotonic() - t0, 1)}


def write_results(results: list[dict], meta: dict) -> None:
    counts = {k: sum(1 for r in results if r["class"] == k) for k in [*CLASSES, PROBE_ERR]}
    RESULTS.write_text(json.dumps({"meta": meta, "counts": counts, "cases": results}, indent=1))


def write_report(results: list[dict], meta: dict) -> None:
    counts = {k: sum(1 for r in results if r["class"] == k) for k in [*CLASSES, PROBE_ERR]}
    lines = ["# emapg adversarial probe: report", "",
             f"Source probed: `{meta['src']}` (commit {meta['commit']}); {len(results)} cases; "
             f"{meta['seconds']:.0f} s; generated by `studies/probe56/probe.py` at {meta['when']}.", "",
             "## Counts", "", "| class | cases |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in counts.items() if v or k in CLASSES]
    lines += ["", "## Counts by root", "", "| root | cases | held | not held |", "|---|---|---|---|"]
    for root in ROOT_NAMES:
        rs = [r for r in results if r["root"] == root]
        if rs:
            held = sum(r["class"] == HELD for r in rs)
            lines.append(f"| {root}: {ROOT_NAMES[root]} | {len(rs)} | {held} | {len(rs) - held} |")
    lines += ["", "## Cases that did not hold", ""]
    for r in results:
        if r["class"] == HELD:
            continue
        lines += [f"### `{r['id']}` ({r['class']}; root {r['root']}: {r['root_name']})", "", r["title"], "",
                  f"**What happened:** {r['detail']}", "", "Reproduction:", "", "```bash",
                  *r["repro"], "```", "", "Output (last lines):", "", "```", *(r["output"] or ["(none)"]), "```", ""]
    lines += ["## Every case", "", "| case | root | class | detail |", "|---|---|---|---|"]
    for r in results:
        d = r["detail"].replace("|", "\\|").replace("\n", " ")[:220]
        lines.append(f"| `{r['id']}` | {r['root']} | {r['class']} | {d} |")
    head = PROBE / "findings_head.md"  # the hand-verified summary of the 2026-12-06 run, kept above the tables
    (PROBE / "REPORT.md").write_text((head.read_text() + "\n" if head.exists() else "") + "\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated case ids")
    ap.add_argument("--root", help="comma-separated roots (1..10, S)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--fresh-fixtures", action="store_true")
    ap.add_argument("--merge", action="store_true", help="update results.json's entries for the cases run")
    args = ap.parse_args()
    chosen = CASES
    if args.only:
        want = set(args.only.split(","))
        chosen = [x for x in CASES if x[0] in want]
    if args.root:
        roots = set(args.root.split(","))
        chosen = [x for x in chosen if x[1] in roots]
    if args.list:
        for name, root, title, _ in chosen:
            print(f"{root:>3} {name:45s} {title}")
        print(len(chosen), "cases")
        return 0
    if not (SRC / "emapg").is_dir():
        raise SystemExit(f"probe: {SRC} has no emapg package (set EMAPG_SRC)")
    build_fixtures(force=args.fresh_fixtures)
    described = subprocess.run(["git", "-C", str(SRC), "describe", "--always", "--dirty"], capture_output=True,
                               text=True)
    commit = described.stdout.strip() or "unknown"
    t0 = time.monotonic()
    meta = {"src": str(SRC), "commit": commit, "when": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": 0}
    previous = []
    if args.merge and RESULTS.exists():
        known = {x[0] for x in CASES}
        previous = [p for p in json.loads(RESULTS.read_text())["cases"] if p["id"] in known]
    results: list[dict] = []
    try:
        for i, (name, root, title, fn) in enumerate(chosen, 1):
            res = run_case(name, root, title, fn)
            results.append(res)
            print(f"[{i}/{len(chosen)}] {res['class']:32s} {name} ({res['seconds']} s): {res['detail'][:160]}",
                  flush=True)
            meta["seconds"] = time.monotonic() - t0
            merged = results
            if previous:
                merged = [next((x for x in results if x["id"] == p["id"]), p) for p in previous] + \
                    [r for r in results if r["id"] not in {p["id"] for p in previous}]
            write_results(merged, meta)
    finally:
        stop_server()
    if previous:
        results = json.loads(RESULTS.read_text())["cases"]
    write_report(results, meta)
    counts = {k: sum(1 for r in results if r["class"] == k) for k in [*CLASSES, PROBE_ERR]}
    print(json.dumps(counts, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
