"""The second adversarial probe's findings (issue 56, 385 cases against e0b3ed4): each case that did not hold, as
a test that failed on that code. Data a command would have lost, results silently wrong, reads that never end,
and tracebacks for a user's mistake; the roots are fixed where they are (one regular-file rule for every file
emapg reads, one typed reader, one bounded answer parser)."""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from emapg.cli import main
from emapg.config import ConfigError, load_config
from emapg.data import DataError, load_rows
from emapg.errors import EmapgError

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "recipes" / "smoke.yaml"


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err


# ---- files that never end: a FIFO waits for a writer for ever, a device such as /dev/zero never stops ---------

@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "f.yaml"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("args", [["train", "--config", "{f}"], ["plan", "--config", "{f}"],
                                  ["compare", "--spec", "{f}", "--out", "{d}/out"]])
def test_a_fifo_given_as_a_file_is_refused_not_read_for_ever(fifo, tmp_path, capsys, args):
    args = [a.format(f=fifo, d=tmp_path) for a in args]
    assert main(args) == 2
    assert f"{fifo}: a FIFO (a named pipe), not a regular file" in one_line(capsys)


def test_every_reader_refuses_a_fifo_or_a_device(tmp_path):
    os.mkfifo(tmp_path / "d.jsonl")
    with pytest.raises(EmapgError, match="d.jsonl: a FIFO"):
        load_rows(tmp_path / "d.jsonl")  # eval --data, task_args.train_file, index build --corpus
    (tmp_path / "z.jsonl").symlink_to("/dev/zero")
    with pytest.raises(EmapgError, match="z.jsonl: a device, not a regular file"):
        load_rows(tmp_path / "z.jsonl")
    child = tmp_path / "child.yaml"
    os.mkfifo(tmp_path / "parent.yaml")
    child.write_text("extends: parent\n")
    with pytest.raises(EmapgError, match="extends: .*parent.yaml: a FIFO"):
        load_config(child)


def test_a_run_file_that_is_a_fifo_is_damaged_and_the_resume_falls_back(tmp_path):
    from emapg.run.checkpoint import CheckpointError, _read_state, latest_checkpoint

    folder = tmp_path / "checkpoints" / "step_000001"
    folder.mkdir(parents=True)
    os.mkfifo(folder / "state.json")
    with pytest.raises(CheckpointError, match="state.json is damaged: not a regular file"):
        _read_state(folder)
    os.mkfifo(tmp_path / "checkpoints" / "latest")
    with pytest.raises(CheckpointError, match="latest is damaged"):
        latest_checkpoint(tmp_path)


# ---- data a command would have lost --------------------------------------------------------------------------

def test_kb_make_never_overwrites_files_that_are_not_its_own(tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "train.jsonl").write_text('{"my": "data"}\n')
    assert main(["kb", "make", "--out", str(mine)]) == 2
    assert "train.jsonl already exist and are not this knowledge base" in one_line(capsys)
    assert (mine / "train.jsonl").read_text() == '{"my": "data"}\n'
    out = tmp_path / "kb"
    assert main(["kb", "make", "--out", str(out)]) == 0 and main(["kb", "make", "--out", str(out)]) == 0  # again


def test_an_export_replaces_only_a_model_folder(tmp_path):
    from emapg.errors import EmapgError
    from emapg.run.export import check_replaceable

    check_replaceable(tmp_path / "absent")
    model = tmp_path / "earlier"
    model.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        (model / name).write_text("x")
    check_replaceable(model)  # an earlier export: replaced
    (model / "notes.txt").write_text("mine")
    with pytest.raises(EmapgError, match=r"holds notes.txt, not a model's files"):
        check_replaceable(model)


def test_compare_moves_no_folder_a_live_writer_holds(tmp_path, capsys):
    import fcntl

    from emapg.lab.study import load_spec, run_all

    spec = tmp_path / "spec.yaml"
    spec.write_text(f"base: {SMOKE}\nseeds: [0]\nconfigs: {{a: [steps=1]}}\n")
    run = tmp_path / "out" / "a" / "seed0"
    run.mkdir(parents=True)
    (run / ".emapg-run").write_text("")
    (run / "metrics.jsonl").write_text("")
    with open(run / ".emapg.lock", "w") as held:  # held as a live `emapg train` holds it (another open file)
        held.write("424242")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(ConfigError, match=r"another emapg process \(PID 424242\) is writing this run folder"):
            run_all(load_spec(spec), tmp_path / "out", log=lambda m: None)
    assert (run / "metrics.jsonl").exists() and not run.with_name("seed0.stale").exists()  # nothing moved


# ---- results silently wrong ------------------------------------------------------------------------------------

def test_a_search_r1_target_given_as_one_string_is_one_answer(tmp_path):
    from emapg.tasks.search_qa import qa_rows

    row = {"data_source": "nq", "prompt": [{"role": "user", "content": "Question: capital of France?\n"}],
           "reward_model": {"ground_truth": {"target": "Paris"}}, "extra_info": {"index": 3}}
    (tmp_path / "d.jsonl").write_text(json.dumps(row) + "\n")
    assert qa_rows(str(tmp_path / "d.jsonl"))[0]["answers"] == ["Paris"]  # was ['P', 'a', 'r', 'i', 's']


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_gold_answer_that_is_not_a_finite_number_is_refused(tmp_path, bad):
    from emapg.tasks.math import math_rows

    (tmp_path / "d.jsonl").write_text(json.dumps({"problem": "p", "answer": bad}) + "\n")
    with pytest.raises(DataError, match="expected text or a finite number"):
        math_rows(str(tmp_path / "d.jsonl"), "problem", "answer")


@pytest.mark.parametrize("gold", ["\\boxed{}", "{}", "\\text{}", "\\boxed{"])
@pytest.mark.parametrize("grader", ["reference", "lenient"])
def test_a_gold_answer_nothing_could_match_is_refused_by_emapgs_grader_and_kept_by_the_reference(tmp_path, gold, grader,
                                                                                                   capsys):
    """The lenient grader refuses such a file at load, naming the row; the reference grader keeps the row, as the
    reference loads it, and names it in a warning."""
    from emapg.tasks.math import MathTask, gradable

    assert not gradable([gold], grader) and gradable(["\\frac{1}{2}"], grader) and gradable(["0"], grader)
    rows = [{"problem": f"p{i}", "answer": "3"} for i in range(3)] + [{"problem": "q", "answer": gold}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if grader == "lenient":
        with pytest.raises(DataError, match="line 4: the answer .* has nothing the lenient grader can match"):
            MathTask(train_file=str(tmp_path / "d.jsonl"), eval_size=1, grader=grader)
        return
    task = MathTask(train_file=str(tmp_path / "d.jsonl"), eval_size=1, grader=grader)
    assert len(task.eval_examples(1)) + len(task.train_pool()) == 4
    assert "line 4" in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["plan", "--config", "smoke", "--response-tokens", "0"], "--response-tokens: must be a finite number > 0, got 0"),
    (["plan", "--config", ""], "--config: empty"),
    (["train", "--config", ""], "--config: empty"),
    (["eval", "--model", "tiny-llama", "--task", "math", "--data", "x="], "--data x=: no file after x="),
    (["train", "--config", "smoke", "wandb_project=x\udcff"], "is not UTF-8 text (byte 0xff)"),
    (["train", "--config", "smoke", "seed=99999999999999999999"], "seed: must be in"),
])
def test_what_was_read_as_not_given_or_passed_on_is_refused(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    try:
        code = main(args)
    except SystemExit as e:  # argparse's own refusal (an argument that is not UTF-8)
        code = e.code
    assert code == 2 and message in one_line(capsys)
    assert not list(tmp_path.iterdir())  # nothing started


# ---- work bounded per completion, and a server that drips its answer -------------------------------------------

def test_the_answer_parser_is_the_regular_expression_in_linear_time():
    from emapg.tags import ANSWER_RE, answers_in, extract_answer

    rng = random.Random(0)
    pieces = ["<answer>", "</answer>", "a", "b\n", "<ans", ">", " "]
    for _ in range(5000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        assert answers_in(text) == ANSWER_RE.findall(text), text
    assert extract_answer("<answer>" * 20000) is None  # the regular expression took seconds here (quadratic)


def test_the_retrieval_client_gives_up_on_a_server_that_drips_its_answer():
    from emapg.retrieval import RetrieverError
    from emapg.retrieval.client import HTTPRetriever

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    stop = threading.Event()

    def drip():
        while not stop.is_set():
            try:
                server.settimeout(0.2)
                conn, _ = server.accept()
            except OSError:
                continue
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
            while not stop.is_set():  # a byte well inside the socket timeout, for ever
                try:
                    conn.sendall(b" ")
                except OSError:
                    break
                time.sleep(0.1)
            conn.close()

    threading.Thread(target=drip, daemon=True).start()
    client = HTTPRetriever(f"http://127.0.0.1:{server.getsockname()[1]}", timeout=1.0, retries=1, backoff=0.1)
    t0 = time.monotonic()
    try:
        with pytest.raises(RetrieverError, match="failed after 2 attempts: TimeoutError"):
            client.search(["q"], 1)  # its GET /health drips too: bounded as well
    finally:
        stop.set()
        server.close()
    assert time.monotonic() - t0 < 30  # a deadline per attempt (it never returned before)


# ---- tracebacks for a user's mistake ---------------------------------------------------------------------------

def test_a_state_json_with_a_wrong_optimizer_is_damaged(tmp_path):
    from emapg.run.checkpoint import CheckpointError, _read_state

    folder = tmp_path / "step_000001"
    folder.mkdir()
    for bad in (None, {"param_groups": "x"}, {"param_groups": [1]}):
        (folder / "state.json").write_text(json.dumps({"step": 1, "optimizer": bad}))
        with pytest.raises(CheckpointError, match="state.json is damaged: its optimizer is"):
            _read_state(folder)


@pytest.mark.parametrize("file,text,message", [
    ("eval.json", "[1, 2]", "eval.json: expected {policy: {accuracy: N}, ...}, got [1, 2]"),
    ("eval.json", '{"init": {"accuracy": 0.5}}', "eval.json: expected {policy"),
    ("eval.json", '{"policy": ', "eval.json: damaged (JSONDecodeError"),
    ("compute.json", "{garbage", "compute.json: damaged"),
    ("metrics.jsonl", "", "metrics.jsonl: no rows"),
])
def test_a_studys_report_names_a_damaged_run_file(tmp_path, file, text, message):
    from emapg.lab.report import summarize
    from emapg.lab.study import Spec

    run = tmp_path / "a" / "seed0"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.5, "eval/policy_accuracy": 0.5}) + "\n")
    (run / "eval.json").write_text(json.dumps({"policy": {"accuracy": 0.5}}))
    (run / "compute.json").write_text(json.dumps({"seconds": 1.0}))
    (run / file).write_text(text)
    with pytest.raises(EmapgError, match=message.replace("[", r"\[").replace("(", r"\(").replace("{", r"\{")):
        summarize(Spec(base=SMOKE, overrides=[], seeds=[0], configs={"a": []}), tmp_path)


def test_an_index_cut_short_is_named(tmp_path):
    from emapg.retrieval.passages import PASSAGES_FILE, read_passages

    (tmp_path / PASSAGES_FILE).write_text('{"id": "1", "title": "t", "text": "x"}\n{"id": "2", "ti')
    with pytest.raises(DataError, match=f"{PASSAGES_FILE}, line 2: damaged"):
        read_passages(tmp_path)


@pytest.mark.parametrize("change,message", [
    ({"num_key_value_heads": 0}, "num_key_value_heads is 0, expected a whole number >= 1"),
    ({"num_key_value_heads": 3}, "num_attention_heads (16) is not a multiple of num_key_value_heads (3)"),
    ({"head_dim": 0}, "head_dim is 0"),
    ({"hidden_size": 64.5}, "config.json: Validation error for field 'hidden_size'"),
    ({"vocab_size": "removed"}, "config.json has no vocab_size"),
])
def test_the_plan_names_a_config_json_no_model_could_have(tmp_path, change, message):
    from emapg.models import plan as P

    config = json.loads((ROOT / "tests/fixtures/model_configs/qwen2.5-3b/config.json").read_text())
    config = {k: v for k, v in {**config, **change}.items() if v != "removed"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        P.shape_of(P.model_config(str(tmp_path)))


def test_an_extended_file_that_is_not_utf8_names_its_line(tmp_path):
    (tmp_path / "base.yaml").write_bytes(b"model: tiny-llama\n# caf\xe9\n")
    (tmp_path / "child.yaml").write_text("extends: base\n")
    with pytest.raises(ConfigError, match=r"extends: .*base.yaml, line 2: not UTF-8 text \(byte 0xe9\)"):
        load_config(tmp_path / "child.yaml")


def test_a_plugin_task_passing_an_unknown_keyword_on_is_named(monkeypatch):
    from emapg.tasks import TASKS, make_task
    from emapg.tasks.arithmetic import ArithmeticTask

    class Loose(ArithmeticTask):
        def __init__(self, digits: int = 1, **kwargs):
            super().__init__(digits=digits, **kwargs)

    monkeypatch.setitem(TASKS, "loose", Loose)
    with pytest.raises(ConfigError, match="task_args.digitz: task loose does not take it"):
        make_task("loose", digitz=2)


def test_lora_targets_that_name_no_module_are_named():
    from emapg.models.zoo import policy_model

    cfg = load_config(SMOKE, ["lora.r=4", "lora.target_modules=[nope]"])
    with pytest.raises(ConfigError, match=r"lora.target_modules: \['nope'\] names no module of tiny-llama"):
        policy_model(cfg)


def test_a_cut_weights_file_is_named(tmp_path):
    from emapg.models.zoo import load_model, save_hf_folder

    model, tok = load_model("tiny-llama")
    save_hf_folder(model, tok, tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    with pytest.raises(ConfigError, match=r"model: .*m: model.safetensors cannot be read"):
        load_model(str(tmp_path / "m"))


def test_a_batch_that_does_not_split_over_nproc_is_refused_before_torchrun(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--nproc", "2", "--config", "smoke", "--out", "r", "prompts_per_step=3",
                 "micro_batch_prompts=1"]) == 2
    assert "prompts_per_step: 3 does not split over 2 processes" in one_line(capsys)
    assert not (tmp_path / "r").exists()


def test_a_run_folders_plugins_given_as_one_string_are_named_whole(tmp_path):
    (tmp_path / ".emapg-run").write_text("{}")  # a run folder's config
    (tmp_path / "config.yaml").write_text("plugins: /somewhere/evil.py\nmodel: tiny-llama\n")
    with pytest.raises(ConfigError, match=r"it names plugins \(/somewhere/evil.py\)"):
        load_config(tmp_path / "config.yaml", trust_plugins=False)


def test_math_is_finite_everywhere_a_gold_is_read():
    from emapg.data import answer_text

    assert answer_text(142.0) == "142" and answer_text(2.5) == "2.5"
    with pytest.raises(DataError):
        answer_text(math.nan)


def test_eval_size_is_at_most_the_held_out_set_for_a_generated_task_too(capsys):
    """`emapg eval --task arithmetic` with its default --size (100,000) said "eval.size: 100000 exceeds the task's
    held-out set of 500"; --size is "at most this many" for every task, and --size 0 (which evaluated every
    problem of a file, but no arithmetic) is refused: eval.size 0 means no evaluation in training."""
    from emapg.run.evalsuite import sets_of
    from emapg.tasks.arithmetic import ArithmeticTask

    task = ArithmeticTask(eval_size=20)
    for size, expected in ((100_000, 20), (20, 20), (7, 7)):
        [(name, examples)] = sets_of(task, "heldout", size)
        assert name == "heldout" and len(examples) == expected
    assert main(["eval", "--model", "tiny-llama", "--task", "arithmetic", "--size", "0"]) == 2
    assert "--size: must be >= 1, got 0" in one_line(capsys)


class _CountingTokenizer:
    """A tokenizer that records the longest text it was asked to tokenize."""

    def __init__(self, inner):
        self.inner, self.longest = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, text, *a, **k):
        self.longest = max(self.longest, len(text))
        return self.inner(text, *a, **k)

    def apply_chat_template(self, messages, *a, **k):
        self.longest = max(self.longest, sum(len(m["content"]) for m in messages))
        return self.inner.apply_chat_template(messages, *a, **k)

    def encode(self, text, *a, **k):
        self.longest = max(self.longest, len(text))
        return self.inner.encode(text, *a, **k)


@pytest.mark.parametrize("mode", ["error", "truncate"])
def test_a_prompt_of_megabytes_is_bounded_by_its_size_before_it_is_tokenized(tmp_path, capsys, mode):
    """A data file whose first problem is 3 MB: refused (or cut, with long_prompts: truncate) from its size in bytes,
    a lower bound on its tokens, without tokenizing the text whole (it took 14 s a MB)."""
    from emapg.models.lm import longest_token_bytes
    from emapg.models.zoo import load_model
    from emapg.rollout.prompts import fit_prompts
    from emapg.tasks import make_task

    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"problem": "1 + 1 = ? " * 300_000, "answer": "2"}) + "\n"
                    + json.dumps({"problem": "2 + 2?", "answer": "4"}) + "\n")
    task = make_task("math", train_file=str(data), eval_file=str(data))
    tok = _CountingTokenizer(load_model("tiny-qwen2", "float32")[1])
    room = 2048 - 64
    if mode == "error":
        with pytest.raises(Exception, match=r"line 1: the prompt has 3,000,\d+ bytes, at least [\d,]+ tokens"):
            fit_prompts(task, tok, 2048, 64, mode)
    else:
        assert fit_prompts(task, tok, 2048, 64, mode, warn=True) == 2  # the row in both pools
        assert "prompt of 3,000," in capsys.readouterr().err
        longest = max(len(ex.messages[-1]["content"]) for ex in task.prompt_pools()[0])
        assert longest < 3 * room * longest_token_bytes(tok)
    assert tok.longest <= room * longest_token_bytes(tok) + 100  # never the 3 MB text


def test_symlinks_never_lead_a_run_out_of_its_folder(tmp_path, capsys):
    """A checkpoints/ linked to another run's is refused before anything is read, pruned or repointed; a step_N
    linked to another run's is not resumed (said) and not pruned; latest as a folder is refused in one line; an
    export into the run's checkpoints (which the next prune deletes) is refused."""
    from emapg.cli import main
    from emapg.run.checkpoint import has_checkpoint
    from emapg.run.export import export_checkpoint

    fast = ["--config", "smoke", "eval.size=0", "export=false", "save_every=1"]
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["train", *fast, "--out", str(a), "steps=2"]) == 0
    assert main(["train", *fast, "--out", str(b), "steps=1"]) == 0
    theirs = sorted(p.name for p in (a / "checkpoints").iterdir())
    # b's checkpoints replaced by a link to a's: refused, a's files untouched
    shutil.move(b / "checkpoints", tmp_path / "b-own")
    (b / "checkpoints").symlink_to(a / "checkpoints")
    assert main(["train", "--resume", str(b), "steps=3"]) == 2
    assert "leads out of the run folder" in capsys.readouterr().err
    assert sorted(p.name for p in (a / "checkpoints").iterdir()) == theirs
    # a step_N of b's linked to a's step_2: not resumed, not pruned
    (b / "checkpoints").unlink()
    shutil.move(tmp_path / "b-own", b / "checkpoints")
    (b / "checkpoints" / "step_000002").symlink_to(a / "checkpoints" / "step_000002")
    assert main(["train", "--resume", str(b), "steps=2"]) == 0
    err = capsys.readouterr().err
    assert "step_000002 leads out of the run folder" in err
    assert (a / "checkpoints" / "step_000002" / "state.json").exists()
    assert (b / "checkpoints" / "step_000002").is_symlink() is False  # b saved its own step 2 in its place
    # latest as a folder: one line, nothing changed
    (b / "checkpoints" / "latest").unlink()
    (b / "checkpoints" / "latest").mkdir()
    assert main(["train", "--resume", str(b), "steps=3"]) == 2
    assert "latest is not emapg's pointer file (a folder)" in capsys.readouterr().err
    with pytest.raises(Exception, match="not emapg's pointer file"):
        has_checkpoint(b)
    # an export into the run's checkpoints
    with pytest.raises(Exception, match="inside the run's checkpoints"):
        export_checkpoint(a, out=a / "checkpoints" / "step_000002" / "x")


def test_files_read_back_are_checked_by_what_they_must_hold(tmp_path, capsys):
    """An optimizer state with no param_groups, or naming a parameter the model has not, is a damaged checkpoint
    (the older one resumes, not a torch size error at the first step); a metrics.jsonl with a stray byte is named,
    not rewritten with U+FFFD; a config.json of null is one line from `emapg plan`, not a TypeError."""
    from emapg.cli import main

    fast = ["--config", "smoke", "eval.size=0", "export=false", "save_every=1", "keep_checkpoints=3"]
    run = tmp_path / "run"
    assert main(["train", *fast, "--out", str(run), "steps=2"]) == 0
    state = run / "checkpoints" / "step_000002" / "state.json"
    data = json.loads(state.read_text())
    data["optimizer"]["param_groups"] = []
    state.write_text(json.dumps(data))
    assert main(["train", "--resume", str(run), "steps=3"]) == 0
    err = capsys.readouterr().err
    assert "state.json is damaged: its optimizer" in err and "resuming from" in err and "step 1" in err
    state = run / "checkpoints" / "step_000003" / "state.json"
    data = json.loads(state.read_text())
    data["optimizer"]["param_groups"][0]["params"][0] = "no.such.param"  # was Adam's size error at the next step
    state.write_text(json.dumps(data))
    assert main(["train", "--resume", str(run), "steps=4"]) == 0
    err = capsys.readouterr().err
    assert "its optimizer names 'no.such.param', which this run's model has not" in err and "(step 2)" in err
    metrics = run / "metrics.jsonl"
    before = metrics.read_bytes()
    metrics.write_bytes(before.replace(b'"step": 2', b'"step": 2, "x": "\xff"', 1))
    assert main(["train", "--resume", str(run), "steps=5"]) == 2
    assert "metrics.jsonl, line 2: not UTF-8 text (byte 0xff)" in capsys.readouterr().err
    assert metrics.read_bytes().count(b"\xff") == 1  # as it was: nothing rewritten
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("null")
    assert main(["plan", "--config", "smoke", f"model={tmp_path / 'm'}", "--device", "cpu"]) == 2
    assert "config.json holds null, not a JSON object" in capsys.readouterr().err



def test_a_config_or_spec_giving_a_key_twice_is_refused_naming_both_lines(tmp_path, capsys):
    from emapg.cli import main

    (tmp_path / "c.yaml").write_text("steps: 3\nlr: 1.0e-3\nalgo: {eta: 0.9, eta: 0.5}\n")
    assert main(["train", "--config", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "r")]) == 2
    assert "key 'eta' is given twice, on line 3 and line 3" in capsys.readouterr().err
    (tmp_path / "s.yaml").write_text("base: c.yaml\nseeds: [0]\nconfigs: {a: []}\nseeds: [1]\n")
    assert main(["compare", "--spec", str(tmp_path / "s.yaml"), "--out", str(tmp_path / "o")]) == 2
    assert "key 'seeds' is given twice, on line 2 and line 4" in capsys.readouterr().err
    (tmp_path / "m.yaml").write_text("steps: 3\nb: &b {eta: 0.9}\nalgo: {<<: *b, beta: 0.5}\n")
    assert main(["train", "--config", str(tmp_path / "m.yaml"), "--out", str(tmp_path / "r")]) == 2
    assert "line 3: invalid YAML: a YAML merge key (<<) is not supported here" in capsys.readouterr().err


def test_the_lenient_grader_takes_the_gold_written_out_whatever_its_size():
    from emapg.rewards.math import math_reward

    gold = "7" * 4_500  # past Python's int digits limit, which sympy's parse meets
    assert math_reward(f"so \\boxed{{{gold}}}", gold) == 1.0 and math_reward(f"so \\boxed{{{gold}8}}", gold) == 0.0
    gold = "12345678" * 600  # 4,800 digits, written otherwise than the gold: read whole, not cut at Python's 4,300
    assert math_reward(f"So the answer is {gold}", gold) == 1.0
    assert math_reward(f"\\boxed{{{gold}}}", gold + ".0") == 1.0
    assert math_reward(f"\\boxed{{\\frac{{{gold}}}{{1}}}}", gold) == 1.0
    assert math_reward(f"So the answer is {gold[:-1]}9", gold) == 0.0


def test_an_index_has_one_writer(tmp_path, capsys):
    """Two `index build --out SAME` at once both said they succeeded while the last rename won: the second is
    refused, naming the first's PID, and writes nothing; once the first is done, a build runs."""
    import fcntl

    from emapg.cli import main

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "title": f"t{i}", "text": f"word{i} text"}) + "\n"
                              for i in range(5)))
    out = tmp_path / "ix"
    with open(tmp_path / ".ix.emapg-lock", "a+") as held:  # another process's build, as the OS sees it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("4242\n")
        held.flush()
        assert main(["index", "build", "--corpus", str(corpus), "--out", str(out)]) == 2
        assert "another emapg (PID 4242) is writing it" in capsys.readouterr().err and not out.exists()
    assert main(["index", "build", "--corpus", str(corpus), "--out", str(out)]) == 0 and out.exists()


def test_eval_checks_only_the_rows_it_evaluates_and_advises_what_eval_has(tmp_path, capsys):
    """`emapg eval --size 1` of a file whose second row is too long for the context: the first row is evaluated;
    with --size 2 the refusal names the row and advises what eval can do (it has no long_prompts)."""
    from emapg.cli import main

    data = tmp_path / "set.jsonl"
    data.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n"
                    + json.dumps({"problem": "long " * 3000, "answer": "3"}) + "\n")
    common = ["eval", "--model", "tiny-llama", "--task", "math", "--data", str(data), "--max-new-tokens", "4",
              "--device", "cpu"]
    assert main([*common, "--size", "1"]) == 0
    assert main([*common, "--size", "2"]) == 2
    err = capsys.readouterr().err
    assert "set.jsonl, line 2: the prompt has" in err and "leave the row out of the file" in err
    assert "long_prompts" not in err


@pytest.mark.parametrize("text,message", [("configs: {}\n", "configs: expected at least one config"),
                                          ("seeds: []\nconfigs: {a: []}\n", "seeds: repeats a seed or lists none")])
def test_a_spec_that_would_run_nothing_is_refused(tmp_path, capsys, text, message):
    from emapg.cli import main

    (tmp_path / "s.yaml").write_text(f"base: {ROOT / 'recipes' / 'smoke.yaml'}\n" + text)
    assert main(["compare", "--spec", str(tmp_path / "s.yaml"), "--out", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err


def test_the_plan_never_allocates_a_shape_it_cannot_measure(tmp_path, capsys):
    """A config.json whose layer holds terabytes and whose widths share too few divisors to measure it narrower
    (it tried to allocate 4 TB): one line, before anything is allocated."""
    from emapg.cli import main

    config = json.loads((ROOT / "tests" / "fixtures" / "model_configs" / "deepseek-r1-distill-qwen-7b" /
                         "config.json").read_text())
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "hidden_size": 28 * 36_000,
                                                            "intermediate_size": 10**6}))
    assert main(["plan", "--config", "smoke", f"model={tmp_path / 'm'}", "--device", "cpu"]) == 2
    assert "too wide to measure its activations within 8 GiB" in capsys.readouterr().err


def test_a_plan_that_cannot_allocate_its_measurement_says_so_in_one_line(tmp_path):
    """A layer 10^6 wide with 4 heads of 16 shares too few divisors to be measured narrower and is measured whole
    (6.5 GiB of weights): on a machine that cannot give that (here a 4 GB address-space limit) it was torch's
    allocator traceback; it is one line naming the shape."""
    import resource

    from emapg.models.zoo import tiny_model

    config = {**tiny_model().config.to_dict(), "hidden_size": 10**6, "head_dim": 16}
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (4 * 10**9, 4 * 10**9))

    done = subprocess.run([sys.executable, "-m", "emapg", "plan", "--config", "smoke", f"model={tmp_path / 'm'}",
                           "--device", "cpu"], capture_output=True, text=True, preexec_fn=cap, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and "(hidden_size 1000000, intermediate_size 128, 4 heads) is measured in " \
        "copies holding 6.5 GiB of weights, more than this machine could allocate (can't allocate memory" in done.stderr


def test_a_search_row_whose_answers_are_null_is_said_null_not_missing(tmp_path):
    from emapg.data import DataError
    from emapg.tasks.search_qa import qa_rows

    data = tmp_path / "qa.jsonl"
    data.write_text(json.dumps({"question": "who?", "answers": None}) + "\n")
    with pytest.raises(DataError, match=r"qa.jsonl, line 1: field 'answers' is null \(expected the answers\)"):
        qa_rows(str(data))


def test_a_bad_value_is_blamed_on_the_file_that_set_it(tmp_path):
    """A value set in a parent config is blamed on the parent, not on the child that extends it; the child's own
    value on the child."""
    (tmp_path / "parent.yaml").write_text("extends: smoke\nlr: -1\nalgo: {eta: 2.0}\n")
    (tmp_path / "child.yaml").write_text("extends: parent\nsteps: 3\nalgo: {k: 8}\n")
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "child.yaml")
    assert str(e.value).startswith(f"{tmp_path / 'parent.yaml'}: 2 problems: line 2: lr: must be")
    assert "algo.eta: must be in (0, 1], got 2.0" in str(e.value)
    (tmp_path / "child.yaml").write_text("extends: parent\nlr: -2\nalgo: {eta: 0.5}\n")
    with pytest.raises(ConfigError, match=r"child.yaml, line 2: lr: must be a finite number > 0, got -2"):
        load_config(tmp_path / "child.yaml")


def test_the_newcomers_cli_answers(tmp_path, capsys):
    """`emapg recipes` gives each recipe's first sentence whole; `kb make --help` names the five files it writes; a
    resume says where it starts; `eval` of a math set defaults to a budget a reasoning answer fits."""
    from emapg.cli import main
    from emapg.commands import EVAL_DEFAULTS, TASK_EVAL_DEFAULTS

    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    assert "2-digit addition, on a 2-core CPU." in out and "(its RESUME_FROM_PATH;\n" not in out
    with pytest.raises(SystemExit):
        main(["kb", "make", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert all(f in shown for f in ("corpus.jsonl", "train.jsonl", "eval.jsonl", "train_one_hop.jsonl",
                                    "eval_one_hop.jsonl")), shown
    fast = ["--config", "smoke", "eval.size=0", "export=false", "save_every=1"]
    assert main(["train", *fast, "--out", str(tmp_path / "r"), "steps=1"]) == 0
    assert main(["train", "--resume", str(tmp_path / "r"), "steps=2"]) == 0
    assert "emapg: resumed at step 1, training on to step 2" in capsys.readouterr().err
    assert TASK_EVAL_DEFAULTS["math"]["max_new_tokens"] >= 1024 > EVAL_DEFAULTS["max_new_tokens"]


def test_a_studys_summary_is_strict_json(tmp_path):
    from emapg.lab.report import _finite

    assert json.dumps(_finite({"a": [float("nan"), 1.0], "b": (float("inf"), 2)}), allow_nan=False) == \
        '{"a": [null, 1.0], "b": [null, 2]}'
    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")

    for path in (ROOT / "studies").glob("*/summary.json"):
        json.loads(path.read_text(), parse_constant=refuse)


def test_a_plan_of_a_billion_layers_is_one_line_and_a_deep_model_is_counted_whole(tmp_path, capsys):
    """num_hidden_layers 10^9 took minutes in transformers' config (a type per layer) and died: one line at once.
    Past any real depth the shape is built with two layers and the rest counted as their copies, the same count as
    the model built whole."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from emapg.cli import main
    from emapg.models.plan import MAX_BUILT_LAYERS, shape_of

    config = json.loads((ROOT / "tests" / "fixtures" / "model_configs" / "deepseek-r1-distill-qwen-7b" /
                         "config.json").read_text())
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10**9}))
    assert main(["plan", "--config", "smoke", f"model={tmp_path / 'm'}", "--device", "cpu"]) == 2
    assert "gives num_hidden_layers 1,000,000,000; emapg plans at most 100,000 layers" in capsys.readouterr().err
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "num_attention_heads": 0}))
    assert main(["plan", "--config", "smoke", f"model={tmp_path / 'm'}", "--device", "cpu"]) == 2
    assert "config.json's num_attention_heads is 0, expected a whole number >= 1" in capsys.readouterr().err
    deep = LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                       vocab_size=64, num_hidden_layers=MAX_BUILT_LAYERS + 37)
    with torch.device("meta"):
        whole = AutoModelForCausalLM.from_config(deep)
    shape = shape_of(deep)
    assert shape.layers == MAX_BUILT_LAYERS + 37
    assert shape.params == sum(p.numel() for p in whole.parameters())


def test_a_study_whose_report_would_write_over_its_own_base_config_is_refused_before_any_run(tmp_path, capsys):
    """A base config named results.md inside --out was trained from and then overwritten by the report."""
    from emapg.cli import main

    base = tmp_path / "results.md"
    base.write_text(f"extends: {ROOT / 'recipes' / 'smoke.yaml'}\nsteps: 1\n")
    (tmp_path / "s.yaml").write_text(f"base: {base}\nseeds: [0]\nconfigs: {{a: []}}\n")
    for extra in ([], ["--report-only"]):
        assert main(["compare", "--spec", str(tmp_path / "s.yaml"), "--out", str(tmp_path), *extra]) == 2
        assert "which is" in capsys.readouterr().err and base.read_text().endswith("steps: 1\n")
    assert not (tmp_path / "a").exists()


def _smoke_run(main, out: Path, *extra: str) -> Path:
    assert main(["train", "--config", "smoke", "eval.size=0", "export=false", "save_every=1", "--out", str(out),
                 "steps=2", *extra]) == 0
    return out


def test_no_link_leads_a_run_or_its_export_out_of_its_folder(tmp_path, capsys):
    """The independent re-probe of issue 70: a resume through an export/, outcomes/ or tensorboard/ linked to
    another run's replaced that run's models or appended to its rows; an export into another run's folder (its
    checkpoints, which it prunes, or its export) was written; `export --step` through a linked step or checkpoints
    exported another run's weights. Each is refused in one line and the other run is untouched."""
    from emapg.cli import main

    a, b = _smoke_run(main, tmp_path / "a", "export=true"), _smoke_run(main, tmp_path / "b")
    theirs = {p: p.read_bytes() for p in sorted(a.rglob("*")) if p.is_file() and p.name != ".emapg.lock"}
    for name in ("export", "outcomes", "tensorboard"):
        target = b / name
        if target.exists():
            shutil.rmtree(target)
        target.symlink_to(a / name)
        assert main(["train", "--resume", str(b), "steps=3"]) == 2
        assert f"{target} leads out of the run folder" in capsys.readouterr().err
        target.unlink()
    for out in (a / "checkpoints" / "step_000002" / "x", a / "export", a / "mine"):
        assert main(["export", str(b), "--out", str(out)]) == 2
        assert "inside another run's folder" in capsys.readouterr().err
    shutil.rmtree(b / "checkpoints" / "step_000002")
    (b / "checkpoints" / "step_000002").symlink_to(a / "checkpoints" / "step_000002")
    assert main(["export", str(b), "--step", "2", "--out", str(tmp_path / "e")]) == 2
    assert "leads out of the run folder" in capsys.readouterr().err and not (tmp_path / "e").exists()
    assert {p: p.read_bytes() for p in sorted(a.rglob("*")) if p.is_file() and p.name != ".emapg.lock"} == theirs


def test_a_run_config_names_no_plugin_without_trust_even_without_its_marker(tmp_path, capsys):
    """A run folder copied without its hidden marker (`cp -a run/* copy/`): --resume, eval --run and export read
    its config.yaml, a run's, and import none of its plugins without --trust-plugins."""
    from emapg.cli import main

    marker = tmp_path / "PWNED"
    (tmp_path / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    run = _smoke_run(main, tmp_path / "run", f"plugins=[{tmp_path / 'evil.py'}]")
    marker.unlink()
    copy = tmp_path / "copy"
    copy.mkdir()
    for p in run.iterdir():
        if not p.name.startswith("."):
            (shutil.copytree if p.is_dir() else shutil.copy2)(p, copy / p.name)
    for argv in (["train", "--resume", str(copy), "steps=3"], ["export", str(copy), "--out", str(tmp_path / "e")],
                 ["eval", "--run", str(copy), "--size", "2", "--max-new-tokens", "2"]):
        assert main(argv) == 2, argv
        assert "--trust-plugins" in capsys.readouterr().err and not marker.exists(), argv


def test_compare_resumes_or_reports_only_the_runs_its_spec_gives(tmp_path, capsys):
    """Another run copied into --out (other settings, or plugins the user never named) was reported as the spec's,
    or resumed with --trust-plugins compare added itself; a spec inside a run folder, or a config at the top of a
    compare's --out, brought plugins unasked."""
    from emapg.cli import main

    spec = tmp_path / "s.yaml"
    spec.write_text(f"base: {ROOT / 'recipes' / 'smoke.yaml'}\nseeds: [0]\noverrides: [steps=2, eval.size=0, "
                    "export=false, save_every=1]\nconfigs: {a: [algo.eta=0.5]}\n")
    _smoke_run(main, tmp_path / "out" / "a" / "seed0", "algo.eta=0.9")
    assert main(["compare", "--spec", str(spec), "--out", str(tmp_path / "out")]) == 2
    assert "holds a run that is not the spec's (algo.eta 0.9 (the spec: 0.5)" in capsys.readouterr().err
    marker = tmp_path / "PWNED"
    (tmp_path / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    run = _smoke_run(main, tmp_path / "r", f"plugins=[{tmp_path / 'evil.py'}]")
    marker.unlink()
    (run / "s.yaml").write_text(f"base: {ROOT / 'recipes' / 'smoke.yaml'}\nseeds: [0]\n"
                                f"configs: {{a: ['plugins=[{tmp_path / 'evil.py'}]']}}\n")
    assert main(["compare", "--spec", str(run / "s.yaml"), "--out", str(tmp_path / "o2")]) == 2
    assert "--trust-plugins" in capsys.readouterr().err and not marker.exists()
    # a config at the top of a compare's --out (a folder emapg wrote runs into, a job may write there): the same
    out = tmp_path / "out"
    shutil.copy(run / "config.yaml", out / "theirs.yaml")
    assert (out / ".compare.lock").exists()
    assert main(["plan", "--config", str(out / "theirs.yaml"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert f"inside the run folder {out}: a config from a run folder imports none" in err and not marker.exists()


def test_outcomes_and_keys_read_back_are_named_not_a_traceback(tmp_path, capsys):
    """outcomes.jsonl with a stray byte or a row whose step is not a number gave a traceback on resume; a config
    key that is not text (`1: a`) a TypeError far from the file."""
    from emapg.cli import main

    run = _smoke_run(main, tmp_path / "run", "eval.size=2", "eval.every=1")
    outcomes = run / "outcomes" / "outcomes.jsonl"
    good = outcomes.read_bytes()
    for bad, said in ((b'{"step": 1, "x": "\xff"}\n', "not UTF-8 text"), (b'{"step": "x"}\n', "step 'x'"),
                      (b"[1]\n", "a JSON list")):
        outcomes.write_bytes(bad + good)
        assert main(["train", "--resume", str(run), "steps=3"]) == 2
        err = capsys.readouterr().err
        assert f"{outcomes}, line 1" in err and said in err and "Traceback" not in err, err
        assert outcomes.read_bytes() == bad + good
    (run / "config.yaml").write_text("null\n")
    assert main(["train", "--resume", str(run), "steps=3"]) == 2
    assert "the run's config is empty" in capsys.readouterr().err
    (tmp_path / "c.yaml").write_text("extends: smoke\n1: a\n")
    assert main(["train", "--config", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "r")]) == 2
    assert "key 1 on line 2 is not a name" in capsys.readouterr().err


def test_an_index_has_one_writer_by_whatever_name(tmp_path, capsys):
    """A build through a link to the folder another build is writing: refused (the lock was keyed by the name)."""
    import fcntl

    from emapg.cli import main

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "title": f"t{i}", "text": f"w{i}"}) + "\n" for i in range(3)))
    (tmp_path / "ix").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "ix")
    with open(tmp_path / ".ix.emapg-lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("4242\n")
        held.flush()
        assert main(["index", "build", "--corpus", str(corpus), "--out", str(tmp_path / "link")]) == 2
        assert "another emapg (PID 4242) is writing it" in capsys.readouterr().err
    assert (tmp_path / "link").is_symlink()


def test_a_plugin_task_whose_eval_examples_is_not_a_list_is_named(tmp_path, capsys):
    from emapg.cli import main

    (tmp_path / "none_eval.py").write_text(
        "from emapg.tasks import register_task\nfrom emapg.tasks.arithmetic import ArithmeticTask\n\n\n"
        "class NoneEval(ArithmeticTask):\n    def eval_examples(self, size):\n        return None\n\n\n"
        "register_task('none_eval', NoneEval)\n")
    assert main(["train", "--config", "smoke", "--out", str(tmp_path / "r"), f"plugins=[{tmp_path / 'none_eval.py'}]",
                 "task=none_eval", "eval.size=2", "steps=1"]) == 2
    err = capsys.readouterr().err
    assert "task NoneEval in none_eval.py: eval_examples returned NoneType, expected a list of at most" in err, err


def test_a_retrieved_passage_of_megabytes_is_cut_before_it_is_tokenized():
    """The re-probe's search eval over a 50 MB passage tokenized it whole (38 s, then an 800 MB allocation died):
    the information block is cut to what its token budget could hold first, and its tokens are the whole text's."""
    from emapg.models.zoo import load_model
    from emapg.retrieval import Passage
    from emapg.rollout.agent import _add_information, _Episode
    from emapg.tags import format_information
    from emapg.tasks.base import AgentConfig

    tok = _CountingTokenizer(load_model("tiny-qwen2", "float32")[1])
    cfg = AgentConfig(max_info_tokens=64, max_total_tokens=200)
    passages = [Passage(id="0", title="Big", text="word " * 1_000_000)]
    e = _Episode(prompt=[], tokens=[], mask=[], logp=[], entropy=[], cut=[], topk=[])
    _add_information(e, passages, tok, cfg, k=0)
    assert tok.longest < 200_000  # never the 5 MB text
    whole = tok.inner(format_information(passages), add_special_tokens=False).input_ids[:64]
    assert e.tokens == whole and e.mask == [0] * 64


@pytest.mark.parametrize("value", ["012", "1:30"])
def test_a_number_yaml_1_1_would_change_is_refused_not_read_as_octal_or_base_60(tmp_path, capsys, value):
    """`seed: 012` was read as 10 and `seed: 1:30` as 90 (YAML 1.1's octal and base-60 ints), in a config file and
    in an override alike: the value stays text, which the field's type refuses by name."""
    (tmp_path / "c.yaml").write_text(f"extends: smoke\nseed: {value}\n")
    assert main(["config", "--show", str(tmp_path / "c.yaml")]) == 2
    assert f"seed: expected int, got '{value}'" in capsys.readouterr().err
    assert main(["config", "--show", "smoke", f"seed={value}"]) == 2
    assert f"override seed={value} (over" in capsys.readouterr().err
    assert main(["config", "--show", "smoke", "algo.eta=["]) == 2
    assert "override 'algo.eta=[': its value is not YAML" in capsys.readouterr().err
    assert load_config(SMOKE, ["seed=12", "lr=1.0e-3", "algo.eta=.5"]).seed == 12


def test_a_lock_file_linked_to_another_folders_is_refused_before_it_is_written(tmp_path, capsys):
    """A run's .emapg.lock linked to another run's: the lock was opened through the link and that run's holder PID
    overwritten (or its lock created) before the refusal; now it is refused first and the other file is as it was."""
    run = _smoke_run(main, tmp_path / "run")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / ".emapg.lock").write_text("999\n")
    (run / ".emapg.lock").unlink()
    (run / ".emapg.lock").symlink_to(victim / ".emapg.lock")
    assert main(["train", "--resume", str(run), "steps=3"]) == 2
    assert "a link (to " in capsys.readouterr().err and (victim / ".emapg.lock").read_text() == "999\n"


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_row_nested_past_the_parser_depth_is_named_not_a_recursion_error(tmp_path, suffix):
    data = tmp_path / f"nested{suffix}"
    row = '{"problem": ' + "[" * 200_000 + "]" * 200_000 + ', "answer": "1"}'
    data.write_text(row + "\n" if suffix == ".jsonl" else f"[{row}]")
    with pytest.raises(DataError, match="nested too deeply to read"):
        load_rows(str(data))


def _exported_tiny(folder: Path) -> Path:
    from emapg.models.zoo import load_model, save_hf_folder

    save_hf_folder(*load_model("tiny-llama"), folder)
    return folder


@pytest.mark.parametrize(("change", "message"), [
    (lambda f: (f / "config.json").write_text((f / "config.json").read_text()[:50]), "config.json cannot be read"),
    (lambda f: _edit_json(f / "config.json", model_type="nosuchmodel"), "config.json cannot be read"),
    (lambda f: _edit_json(f / "config.json", vocab_size=100), "model.safetensors do not fit its config.json"),
    (lambda f: _edit_json(f / "config.json", num_hidden_layers=3), "its weights lack 9 tensor(s) its config.json"),
])
def test_a_model_folder_whose_config_and_weights_disagree_is_one_line(tmp_path, change, message):
    """A cut config.json was blamed on the weights; an unknown model_type and a vocabulary the weights do not have
    were transformers' tracebacks; a layer the weights lack was started at random with only transformers' report,
    and evaluated."""
    from emapg.models.zoo import load_model

    folder = _exported_tiny(tmp_path / "m")
    change(folder)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_model(str(folder))


def _edit_json(file: Path, **changes) -> None:
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


def test_weights_that_are_not_finite_are_named_by_eval_and_resume(tmp_path, capsys):
    """NaN weights: `emapg eval` printed 0.0% without a word, a resume crashed in sampling far away."""
    from safetensors.torch import load_file, save_file

    folder = _exported_tiny(tmp_path / "m")
    weights = load_file(folder / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    weights[name][0, 0] = float("nan")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    assert main(["eval", "--model", str(folder), "--task", "arithmetic", "--size", "2", "--max-new-tokens", "2"]) == 2
    assert f"its weights are not finite ({name} holds NaN or infinity)" in capsys.readouterr().err
    run = _smoke_run(main, tmp_path / "run")
    policy = run / "checkpoints" / "step_000002" / "policy.safetensors"
    tensors = load_file(policy)
    tensors[name][0, 0] = float("inf")
    save_file(tensors, policy)
    assert main(["train", "--resume", str(run), "steps=3"]) == 2
    err = capsys.readouterr().err
    assert "step_000002" in err and f"not finite ({name}" in err and "Traceback" not in err


def test_eval_of_a_run_whose_config_is_a_fifo_is_refused_not_read_for_ever(tmp_path):
    run = _smoke_run(main, tmp_path / "run")
    (run / "config.yaml").unlink()
    os.mkfifo(run / "config.yaml")
    done = subprocess.run([sys.executable, "-m", "emapg", "eval", "--run", str(run), "--size", "2"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2 and "a FIFO (a named pipe), not a regular file" in done.stderr, done.stderr[-1000:]
