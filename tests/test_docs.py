"""The docs' commands, run as written: every fenced ```bash and ```python block of README.md and docs/*.md,
and every command of the README's results table, collected from the Markdown (a new command is covered
without a new test).

Every command is checked (fast, default suite): its options parse with emapg's own parser, its config
and overrides load (keys, types and ranges), a comparison spec loads, a script or file it names exists,
a bench script takes the options given, a pip extra exists, a Python block compiles.

Then the blocks run, one command after another in a scratch folder that holds the repository's recipes,
bench, studies and scripts, and the user's files the docs show (USER_FILES: a fenced block whose info string
says ``file=NAME``); each emapg command must give what it promises, not only exit 0 (``promised``: a run's
metrics, checkpoint and end, eval's table and files, export's folders, the plan's verdict...). What a block
needs is marked
after its language (```bash gpu): such a block is checked, never run:
  gpu        a GPU (torchrun over 8 devices, vLLM's CUDA engine)
  own-files  the user's own models or datasets (/models/..., /data/..., a trained search agent)
  network    a download from a hub
  hours      hours of runs even scaled down (the studies)
``slow`` blocks run under ``-m slow`` (scripts/test.sh, what CI runs, runs them after the suite); unmarked ones
in the default suite. Runs are scaled down, the same
way for every block: ``emapg train`` trains tiny-llama for one step (a resume one step past its
checkpoint; tiny-llama-h32 under vLLM, whose CPU attention takes heads of 32 and up), ``emapg eval``
scores 8 problems, ``emapg compare`` runs its spec's quick variant on tiny-llama, ``serve-retriever`` answers /health
on a free port and is stopped at the end of its block, and the paper's model folders are their
hand-written config.json (MODEL_CONFIGS: enough for ``emapg plan``).
``bash scripts/test.sh`` is the suite this test is part of: it is checked, not run.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKS = {"gpu", "own-files", "network", "hours", "slow"}
CHECK_ONLY = {"gpu", "own-files", "network", "hours"}
MODEL_CONFIGS = {"/models/DeepSeek-R1-Distill-Qwen-1.5B": ROOT / "tests/fixtures/model_configs/deepseek-r1-distill-"
                                                           "qwen-1.5b",
                 "/models/Qwen2.5-3B": ROOT / "tests/fixtures/model_configs/qwen2.5-3b"}
def doc_files() -> dict[str, str]:
    """The files the docs give as the user's own, each a fenced block whose info string names it
    (```yaml file=my.yaml): the runnable blocks use them as written, nothing the docs do not show."""
    out = {}
    for doc in DOCS:
        for m in re.finditer(r"^```\w* file=(\S+)\n(.*?)^```", doc.read_text(encoding="utf-8"), re.M | re.S):
            out[m.group(1)] = m.group(2)
    return out


USER_FILES = doc_files()
NEVER_RUN = {("bash", "scripts/test.sh"): "the suite this test is part of (CI runs it)"}
SCRIPT_DIRS = ("recipes", "bench", "studies", "scripts", "examples")


@dataclass
class Block:
    doc: Path
    line: int
    lang: str
    marks: set[str]
    text: str

    def __str__(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def blocks() -> list[Block]:
    found = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for m in re.finditer(r"^```(\w*)([^\n]*)\n(.*?)^```", text, re.M | re.S):
            if m.group(1) in ("bash", "python"):
                found.append(Block(doc, text[:m.start()].count("\n") + 1, m.group(1), set(m.group(2).split()),
                                   m.group(3)))
    return found


COMMAND = re.compile(r"(emapg|python|bash|torchrun) ")  # how a documented command starts


def table_commands() -> list[tuple[str, str]]:
    """(where, command) for each command of the results tables (their last column): README's and RESULTS'."""
    out = []
    for doc in (ROOT / "README.md", ROOT / "docs" / "RESULTS.md"):
        for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            if line.startswith("|") and line.count("|") >= 4:
                for span in re.findall(r"`([^`]+)`", line.rstrip(" |").rsplit("|", 1)[-1]):
                    if COMMAND.match(span):
                        out.append((f"{doc.name}:{n}", span))
    return out


PLACEHOLDERS = {"studies/README.md": {"NAME": "stability"}}  # a doc's placeholder -> a real one, to check it


def _sources() -> list[tuple[str, str]]:
    """(where, text) of every place a command is written outside fenced blocks: the docs, studies/README.md, and
    the examples' module docstrings (the text a user reads first in a file)."""
    import ast

    out = [(str(d.relative_to(ROOT)), d.read_text(encoding="utf-8")) for d in [*DOCS, ROOT / "studies" / "README.md"]]
    for example in sorted((ROOT / "examples").glob("*.py")):
        out.append((str(example.relative_to(ROOT)), ast.get_docstring(ast.parse(example.read_text())) or ""))
    return out


def prose_commands() -> list[tuple[str, str]]:
    """(where, command) of every command written as an indented block (outside fences; a trailing backslash
    continues a line; a bash array ``A=(...)`` before it is expanded where ``"${A[@]}"`` stands), placeholders
    made real (PLACEHOLDERS). Inline code spans are left out: most name a command or an option in a sentence
    (`emapg eval --backend`), not a whole command."""
    out = []
    for where, text in _sources():
        fenced, pending, start, arrays, array = False, "", 0, {}, None
        for n, line in enumerate(text.splitlines(), 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            if fenced:
                continue
            if not line.startswith("    "):
                arrays = {}  # an indented block's arrays end with it
            m = re.match(r"    ([A-Z_]+)=\((.*)", line)
            if array or m:
                array = array or [m.group(1), ""]
                array[1] += " " + (m.group(2) if m else line.strip())
                if array[1].rstrip().endswith(")"):
                    arrays[array[0]] = shlex.join(shlex.split(array[1].rstrip()[:-1]))
                    array = None
                continue
            if pending or (line.startswith("    ") and COMMAND.match(line.strip())):
                start = start if pending else n
                pending += line.strip()
                if pending.endswith("\\"):
                    pending = pending[:-1] + " "
                    continue
                for name, words in arrays.items():
                    pending = pending.replace(f'"${{{name}[@]}}"', words)
                out.append((f"{where}:{start}", pending))
                pending = ""
    for i, (where, cmd) in enumerate(out):
        for said, real in PLACEHOLDERS.get(where.split(":")[0], {}).items():
            cmd = cmd.replace(said, real)
        out[i] = (where, cmd)
    return out


def commands(block: Block) -> list[tuple[int, dict[str, str], list[str]]]:
    """(line, environment, argv) per command of a shell block: continuation lines joined, comments dropped,
    ``NAME=value`` lines kept as variables of the block and ``$NAME`` expanded (a word per token)."""
    env: dict[str, str] = {}
    out, logical, start = [], "", 0
    for i, raw in enumerate(block.text.splitlines()):
        if not logical:
            start = block.line + 1 + i
        logical += raw
        if raw.endswith("\\"):
            logical = logical[:-1] + " "
            continue
        words, logical = shlex.split(logical, comments=True), ""
        prefix = {}
        while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
            name, value = words.pop(0).split("=", 1)
            prefix[name] = value
        if not words:
            env.update(prefix)
            continue
        argv = []
        for w in words:
            argv += shlex.split(env[w[1:]]) if w.startswith("$") and w[1:] in env else [w]
        out.append((start, prefix, argv))
    return out


# ---- checks: every command --------------------------------------------------------------------------


def _emapg_args(argv: list[str]) -> list[str] | None:
    """The arguments after ``emapg`` for any way the docs start it (None: not emapg)."""
    if argv[0] in ("emapg", ".venv/bin/emapg", ".venv-vllm/bin/emapg"):
        return argv[1:]
    if argv[:3] == ["python", "-m", "emapg"]:
        return argv[3:]
    if argv[0] == "torchrun" and "-m" in argv:
        i = argv.index("-m")
        assert argv[i + 1] == "emapg", f"torchrun runs {argv[i + 1]}, not emapg"
        assert all(a.startswith("--") or argv[j - 1].startswith("--") for j, a in enumerate(argv[1:i], 1)), \
            f"torchrun's options: {argv[1:i]}"
        return argv[i + 2:]
    return None


def _repo_file(name: str) -> Path | None:
    path = ROOT / name
    return path if path.exists() else None


def check_emapg(args: list[str]) -> None:
    from emapg.cli import build_parser
    from emapg.commands import recipe_path
    from emapg.config import apply_override, load_config
    from emapg.lab.study import load_spec
    from emapg.tasks import TASKS

    parser = build_parser()
    try:
        ns, extra = parser.parse_known_args(args)
    except SystemExit:
        raise AssertionError(f"emapg's parser refuses: emapg {shlex.join(args)}") from None
    if ns.command in ("train", "plan"):
        ns.overrides += [x for x in extra if "=" in x and not x.startswith("-")]
        extra = [x for x in extra if not ("=" in x and not x.startswith("-"))]
    assert not extra, f"unrecognized arguments {extra}"
    if ns.command in ("train", "plan"):
        overrides = [o for o in ns.overrides]
        if getattr(ns, "resume", None):
            for item in overrides:  # the run's own config is not here: the keys must exist
                apply_override({}, item)
            return
        name = ns.config or "cpu_demo"
        config = _repo_file(name) or (None if name.endswith(".yaml") and "/" not in name else recipe_path(name))
        if config is None:  # the user's own config file: its overrides' keys must exist
            for item in overrides:
                apply_override({}, item)
            return
        load_config(config, overrides)
    elif ns.command == "compare":
        spec = _repo_file(ns.spec)
        assert spec is not None, f"--spec {ns.spec}: no such file in the repository"
        load_spec(spec, quick=ns.quick, only=ns.only, extra=ns.overrides)
    elif ns.command == "eval":
        assert ns.task is None or ns.task in TASKS, f"--task {ns.task}: not one of {sorted(TASKS)}"
        if ns.task_args:
            json.loads(ns.task_args)


def check(argv: list[str]) -> None:
    """A command is what the docs say it is: see the module's docstring."""
    args = _emapg_args(argv)
    if args is not None:
        return check_emapg(args)
    head = argv[0]
    if head == "python":
        script = _repo_file(argv[1])
        assert script is not None, f"{argv[1]}: no such file in the repository"
        source = script.read_text(encoding="utf-8")
        for opt in [a.split("=")[0] for a in argv[2:] if a.startswith("--")]:
            assert f'"{opt}"' in source, f"{argv[1]} has no option {opt}"
    elif head == "bash":
        assert _repo_file(argv[1]) is not None, f"{argv[1]}: no such file in the repository"
        if argv[1] == "scripts/demo.sh":
            check_emapg(["train", *argv[2:]])
    elif head == "pip":
        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        for spec in argv[2:]:
            m = re.fullmatch(r"(?:\.|emapg)\[([\w,-]+)\]", spec)
            if m:
                unknown = set(m.group(1).split(",")) - set(extras)
                assert not unknown, f"no extra {sorted(unknown)} in pyproject.toml"
    elif head == "hf":  # huggingface_hub's command, in the project's venv (huggingface-cli is not, since hub 1.0)
        assert (Path(sys.executable).parent / "hf").exists(), "hf: not in the project's venv"
        assert argv[1] == "download", f"hf {argv[1]}: the docs use hf download only"
    elif head not in ("source", "tensorboard", "gzip", "mv", "cat"):  # the shell's own file tools
        raise AssertionError(f"a command this test does not know how to check: {shlex.join(argv)}")


BLOCKS = blocks()


NEEDS = {"gpu": "# needs: NVIDIA GPUs", "network": "# needs: the network", "slow": "# runs on a CPU",
         "own-files": "# needs: your own files", "hours": "# takes hours"}
"""What a marked block's first line says, where a reader sees it (renderers hide a fence's info string)."""


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_every_documented_command_is_what_it_says(block):
    assert block.marks <= MARKS, f"{block}: unknown marks {block.marks - MARKS} (known: {sorted(MARKS)})"
    for mark in block.marks:  # what the block needs, in its first line (a mark alone cannot be seen rendered)
        assert block.text.startswith(NEEDS[mark]), f"{block}: its first line must say {NEEDS[mark]!r}..."
    if block.lang == "python":
        compile(block.text, str(block), "exec")
        return
    cmds = commands(block)
    assert cmds, f"{block}: a shell block without a command"
    for line, _, argv in cmds:
        try:
            check(argv)
        except Exception as e:  # the doc's place first: where to fix it
            raise AssertionError(f"{block.doc.relative_to(ROOT)}:{line}: {shlex.join(argv)}: {e}") from e


@pytest.mark.parametrize("where,command", table_commands(), ids=[w for w, _ in table_commands()])
def test_every_command_of_the_results_table_is_what_it_says(where, command):
    check(shlex.split(command))


PROSE = prose_commands()


@pytest.mark.parametrize("where,command", PROSE, ids=[w for w, _ in PROSE])
def test_every_command_written_in_prose_is_what_it_says(where, command):
    """Indented blocks are checked as the fenced ones are (not run: several name a user's own folders)."""
    check(shlex.split(command, comments=True))


def test_every_published_figure_and_record_is_referenced():
    """A file in docs/results/ (or a figure in docs/) that no document names is a result nobody can find, or
    one a rerun stopped writing: each is named by README, docs/ or a study's page."""
    texts = "".join(p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
                                                             *(ROOT / "studies").rglob("*.md")])
    files = [*(ROOT / "docs" / "results").iterdir(), *(ROOT / "docs").glob("*.png")]
    assert files and [f.name for f in files if f.name not in texts] == []


def test_the_docs_have_blocks_and_the_readme_table_has_commands():
    """The collection itself: README and USAGE blocks found, so a broken pattern cannot pass by finding none;
    the user's files the blocks name are shown in the docs."""
    assert {"my.yaml", "wiki.jsonl"} <= set(USER_FILES)
    docs = {b.doc.name for b in BLOCKS}
    assert {"README.md", "USAGE.md", "REPRODUCE.md"} <= docs
    assert sum(b.doc.name == "USAGE.md" for b in BLOCKS) >= 8 and len(table_commands()) >= 10
    assert sum(where.startswith("README.md") for where, _ in table_commands()) >= 4
    assert {w.split(":")[0] for w, _ in PROSE} >= {"studies/README.md", "examples/countdown_plugin.py",
                                                   "examples/trl_grpo_ema.py", "docs/BENCHMARKS.md"}


# ---- runs: the blocks that run here ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _latest_step(run: Path) -> int:
    return json.loads((run / "checkpoints" / "latest").read_text())["step"]


def scaled(args: list[str], cwd: Path) -> list[str]:
    """An emapg command as the runs take it (the module's docstring)."""
    args = [f"model={MODEL_CONFIGS[a[6:]]}" if a.startswith("model=") and a[6:] in MODEL_CONFIGS else a for a in args]
    # a path in the repository, written from its root as a user runs it; the runs work in a folder of their own
    args = [f"model={ROOT / a[6:]}" if a.startswith("model=tests/") and (ROOT / a[6:]).exists() else a for a in args]
    sub = args[0]
    if sub == "train":
        if "--resume" in args:
            return [*args, f"steps={_latest_step(cwd / args[args.index('--resume') + 1]) + 1}"]
        return [*args, "model=tiny-llama", "steps=1", "save_every=1", "eval.size=8", "eval.every=0"]
    if sub == "eval":
        return [*args, "--size", "8", "--max-new-tokens", "8"]
    if sub == "compare" and "--report-only" not in args:
        return [*args, "--quick", "model=tiny-llama"]
    if sub == "serve-retriever":
        return [*args, "--port", str(_free_port())]
    return args


def _wait_health(proc: subprocess.Popen, port: int, where: str) -> None:
    end = time.monotonic() + 120
    while time.monotonic() < end:
        assert proc.poll() is None, f"{where}: the server stopped: {proc.stderr.read()}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                assert json.loads(r.read())["status"] == "ok"
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"{where}: the server never answered /health")


def _option(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def _run_folder(args: list[str], cwd: Path, before: set[Path]) -> Path:
    """The folder a train command writes: --out, --resume, or the one it made under runs/."""
    named = _option(args, "--out") or _option(args, "--resume")
    if named:
        return cwd / named
    made = set((cwd / "runs").glob("*")) - before
    assert len(made) == 1, f"train made {len(made)} new folders under runs/: {sorted(made)}"
    return made.pop()


def promised(args: list[str], cwd: Path, stdout: str, before: set[Path]) -> None:
    """What an emapg command the docs run says it gives, checked beyond its exit code (USAGE and --help): a
    run's folder with a metrics row per step trained, its latest checkpoint, its end (the evaluation table, on
    screen and in eval.json); eval's table and files; export's two Hugging Face folders; the plan's verdict;
    compare's results; an index's files; the knowledge base's three files; the recipes' list."""
    sub = args[0]
    if sub == "train":
        run = _run_folder(args, cwd, before)
        from emapg.run.metrics import read_metrics

        rows, last = read_metrics(run), _latest_step(run)
        assert rows and rows[-1]["step"] == last, f"{run.name}: metrics end at {rows[-1]['step']}, checkpoint {last}"
        assert (run / "config.yaml").exists() and (run / "finished.json").exists(), f"{run.name}: no end written"
        if (run / "eval.json").exists():
            assert "| policy |" in stdout, "the run's evaluation table was not printed"
    elif sub == "eval":
        out = _option(args, "--out")
        assert "| average |" in stdout or "avg@" in stdout, "no evaluation table printed"
        if out:
            assert {p.name for p in (cwd / out).iterdir()} >= {"eval.json", "eval.md"}, f"{out}: no eval.json/.md"
    elif sub == "export":
        out = cwd / _option(args, "--out")
        for which in ("policy", "anchor"):
            assert (out / which / "config.json").exists(), f"{out}/{which}: not a Hugging Face folder"
    elif sub == "plan":
        assert "fits: peak" in stdout or "does not" in stdout, "the plan printed no verdict"
    elif sub == "compare":
        out = cwd / _option(args, "--out")
        assert (out / "results.md").exists() and (out / "summary.json").exists(), f"{out}: no results.md"
    elif sub == "recipes":
        assert "cpu_demo" in stdout, "the shipped recipes were not listed"
    elif args[:2] == ["index", "build"]:
        out = cwd / _option(args, "--out")
        assert out.is_dir() and any(out.iterdir()), f"{out}: no index written"
    elif args[:2] == ["kb", "make"]:
        out = cwd / _option(args, "--out")
        assert {"corpus.jsonl", "train.jsonl", "eval.jsonl"} <= {p.name for p in out.iterdir()}


def run_block(block: Block, cwd: Path) -> None:
    for name in SCRIPT_DIRS:
        if not (cwd / name).exists():
            (cwd / name).symlink_to(ROOT / name)
    for name, text in USER_FILES.items():
        (cwd / name).write_text(text, encoding="utf-8")
    # as a user runs them: the activated venv's own `emapg` and `python` first on PATH, the installed package
    # (no PYTHONPATH pointing into the clone: a missing console script or a broken install shows here)
    venv_bin = str(Path(sys.executable).parent)
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "PATH": os.pathsep.join([venv_bin, os.environ.get("PATH", "")])}
    servers = []
    try:
        for line, prefix, argv in commands(block):
            where = f"{block.doc.relative_to(ROOT)}:{line}"
            if tuple(argv[:2]) in NEVER_RUN:
                continue
            args = _emapg_args(argv)
            if args is not None:
                args = scaled(args, cwd)
                if argv[0].startswith(".venv-vllm"):  # vLLM's CPU attention takes heads of 32 and up
                    args = [a.replace("model=tiny-llama", "model=tiny-llama-h32") for a in args]
                exe = [str(ROOT / argv[0])] if argv[0].startswith(".venv") else [str(Path(venv_bin) / "emapg")]
                cmd = [*exe, *args]
            elif argv[0] == "python":
                cmd = [sys.executable, str(ROOT / argv[1]), *argv[2:]]
            elif argv[0] == "bash":
                cmd = ["bash", str(ROOT / argv[1]), *(scaled(["train", *argv[2:]], cwd)[1:] if argv[1] ==
                                                       "scripts/demo.sh" else argv[2:])]
                if argv[1] == "scripts/demo.sh":  # the main job: `emapg train`, whose promises it keeps
                    cmd += ["--out", str(cwd / "runs" / "demo-sh")]
                    args = ["train", "--out", str(cwd / "runs" / "demo-sh")]
            else:
                raise AssertionError(f"{where}: a command this test does not know how to run: {shlex.join(argv)}")
            if args is not None and args[0] == "serve-retriever":
                port = int(args[-1])
                proc = subprocess.Popen(cmd, cwd=cwd, env={**env, **prefix}, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True)
                servers.append(proc)
                _wait_health(proc, port, where)
                continue
            before = set((cwd / "runs").glob("*"))
            done = subprocess.run(cmd, cwd=cwd, env={**env, **prefix}, capture_output=True, text=True, timeout=1800)
            assert done.returncode == 0, f"{where}: {shlex.join(argv)} (run as {shlex.join(cmd)}) exited " \
                                         f"{done.returncode}:\n{done.stderr[-3000:]}"
            assert "Traceback" not in done.stderr, f"{where}: {done.stderr[-3000:]}"
            if args is not None:
                try:
                    promised(args, cwd, done.stdout, before)
                except (AssertionError, OSError) as e:
                    raise AssertionError(f"{where}: {shlex.join(argv)}: {e}") from e
    finally:
        for proc in servers:
            proc.terminate()
            proc.wait(timeout=30)


TRL_SCALE = {  # the TRL snippet's run, scaled down: what it says -> what the run takes (each must be in the snippet)
    "max_steps=30,": "max_steps=1, max_completion_length=8, report_to=[],",  # the shipped model, as written
}


def run_python(block: Block, cwd: Path) -> None:
    code = block.text
    if "EMAPGTrainer(" in code:
        for said, run in TRL_SCALE.items():
            assert said in code, f"{block}: the snippet no longer says {said!r}: update TRL_SCALE"
            code = code.replace(said, run)
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, f"{block}: exited {done.returncode}:\n{done.stderr[-3000:]}"


RUNNABLE = [b for b in BLOCKS if not (b.marks & CHECK_ONLY)]


@pytest.mark.parametrize("block", [pytest.param(b, marks=pytest.mark.slow) if "slow" in b.marks else b
                                   for b in RUNNABLE], ids=[str(b) for b in RUNNABLE])
def test_every_documented_block_runs(block, tmp_path):
    (run_python if block.lang == "python" else run_block)(block, tmp_path)
