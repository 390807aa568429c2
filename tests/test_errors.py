"""A user's mistake gets one clear message that names the field, file or option: no traceback."""

import json
import socket
from pathlib import Path

import pytest

from emapg.cli import main
from emapg.data import DataError, load_rows

SMOKE = Path(__file__).resolve().parents[1] / "recipes" / "smoke.yaml"


@pytest.mark.parametrize("args,message", [
    (["train", "--config", str(SMOKE), "device=cuda", "eval.size=0"], "device cuda: no CUDA device is visible"),
    (["train", "--config", str(SMOKE), "task_args.digits=two"], "task_args.digits: expected an integer, got 'two'"),
    (["train", "--config", "no-such-recipe"], "no such file, and no recipe of that name (recipes: cpu_demo"),
    (["train", "--config", str(SMOKE), "--force"],
     "--force: only with --resume (or a config's init_from)"),
    (["serve-retriever", "--index", "x", "--host", "0.0.0.0"], "--host 0.0.0.0: reachable from the network"),
    (["serve-retriever", "--index", "x", "--host", "::"], "pass --allow-remote"),
    (["serve-retriever", "--index", "x", "--port", "99999"], "--port 99999: expected 0..65535"),
    (["serve-retriever", "--index", "x", "--host", "my laptop"], "--host 'my laptop': expected an IP address"),
    (["serve-retriever", "--index", "x", "--max-queries", "0"], "--max-queries: must be an integer >= 1, got 0"),
    (["serve-retriever", "--index", "x", "--max-body-bytes", "0"], "--max-body-bytes: must be an integer >= 1, got 0"),
])
def test_cli_mistakes_are_one_line_messages(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_an_empty_config_file_is_refused(tmp_path, capsys):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    assert main(["train", "--config", str(empty)]) == 2
    assert f"config file {empty}: the file is empty" in capsys.readouterr().err


def test_a_busy_port_is_named(tmp_path, capsys):
    from emapg.retrieval.bm25 import build_index

    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": "1", "title": "A", "text": "alpha beta"}) + "\n")
    build_index(corpus, tmp_path / "ix")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve-retriever", "--index", str(tmp_path / "ix"), "--port", str(port)]) == 2
    assert f"--port {port}: cannot listen there (Address already in use)" in capsys.readouterr().err


def test_an_index_out_that_exists_is_refused(tmp_path, capsys):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": "1", "title": "A", "text": "alpha"}) + "\n")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    assert main(["index", "build", "--corpus", str(corpus), "--out", str(tmp_path / "taken")]) == 2
    assert "is not an emapg index or an empty folder" in capsys.readouterr().err
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"


def test_data_that_is_not_utf8_names_the_file_and_line(tmp_path):
    bad = tmp_path / "d.jsonl"
    bad.write_bytes(b'{"problem": "1+1", "answer": "2"}\n{"problem": "caf\xe9", "answer": "3"}\n')
    with pytest.raises(DataError, match=r"d.jsonl, line 2: not UTF-8 text \(byte 0xe9"):
        load_rows(bad)
    bad_json = tmp_path / "d.json"
    bad_json.write_bytes(b'[{"problem": "1+1",\n "answer": "\xff"}]')
    with pytest.raises(DataError, match=r"d.json, line 2: not UTF-8"):
        load_rows(bad_json)


def test_a_lone_surrogate_and_a_file_that_is_not_parquet_are_named(tmp_path):
    rows = tmp_path / "d.jsonl"
    rows.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": "smile \\ud83d", "answer": "3"}\n')
    with pytest.raises(DataError, match=r"d.jsonl, line 2: field 'problem': not valid Unicode text \(a lone surrogate"):
        load_rows(rows, required=("problem", "answer"))
    fake = tmp_path / "train.parquet"
    fake.write_text("id,question\n1,what?\n")
    with pytest.raises(DataError, match=r"train.parquet: not a readable Parquet file"):
        load_rows(fake)


def test_a_null_answer_is_called_null_not_missing(tmp_path):
    rows = tmp_path / "d.jsonl"
    rows.write_text('{"problem": "1+1", "answer": null}\n')
    with pytest.raises(DataError, match=r"line 1: field 'answer' is null"):
        load_rows(rows, required=("problem", "answer"))


@pytest.mark.parametrize("mode", ["error", "truncate"])
def test_a_prompt_longer_than_the_context_is_refused_or_cut_before_the_first_step(mode, tmp_path, capsys):
    import time

    from emapg.config import ConfigError, load_config
    from emapg.run.trainer import Trainer

    data = tmp_path / "train.jsonl"
    rows = [{"problem": "What is 1 + 1?", "answer": "2"}, {"problem": "x " * 100_000, "answer": "3"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(SMOKE, ["task=math", f"task_args={{train_file: {data}, eval_file: {data}}}", "eval.size=0",
                              "export=false", f"long_prompts={mode}"])
    t0 = time.perf_counter()
    if mode == "error":
        said = r"train.jsonl, line 2: the prompt has [\d,]+ (tokens|bytes).*context of 2048"
        with pytest.raises(ConfigError, match=said):
            Trainer(cfg, tmp_path / "run", progress=False)
        assert time.perf_counter() - t0 < 60  # found before any step, not after minutes of decoding
        return
    tr = Trainer(cfg, tmp_path / "run", progress=False)
    assert "train.jsonl, line 2: prompt of" in capsys.readouterr().err
    from emapg.rollout.sampling import format_prompt

    pools = tr.run.task.prompt_pools()
    longest = max(len(format_prompt(tr.run.tokenizer, ex.messages)) for pool in pools for ex in pool)
    assert longest + cfg.rollout.max_new_tokens <= 2048
    short, cut = tr.run.task.prompt_pools()[0]
    assert short.messages[-1]["content"].startswith("What is 1 + 1?\n")  # short ones untouched
    assert "[...]" in cut.messages[-1]["content"] and cut.messages[-1]["content"].endswith("\\boxed{}.")


def test_every_option_of_every_command_has_help_and_shows_its_default(capsys):
    """`--help` explains each flag and says its default (eval's --max-new-tokens 32 truncated math silently);
    `emapg recipes` lists every shipped recipe with what it is for; plan's table has no HTML for a terminal."""
    import argparse

    from emapg.cli import build_parser, main
    from emapg.config import SHIPPED_RECIPES

    def parsers(p):
        yield p
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from parsers(sub)

    for parser in parsers(build_parser()):
        for action in parser._actions:
            if action.option_strings and action.dest not in ("help", "version"):
                assert action.help, f"{parser.prog} {action.option_strings[0]}: no help"
        text = parser.format_help()
        assert "(default: None)" not in text and "(default: False)" not in text
    help_text = next(p for p in parsers(build_parser()) if p.prog.endswith(" serve-retriever")).format_help()
    assert "(default: 8000)" in " ".join(help_text.split())
    assert main(["recipes"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert sorted(line.split()[0] for line in listed if not line.startswith(" ")) == \
        sorted(p.stem for p in SHIPPED_RECIPES.glob("*.yaml"))  # (a description wraps onto indented lines)
    assert all(len(line.split()) > 2 for line in listed)  # each with its purpose
    from emapg.models.plan import Phase, Plan, render

    assert "&nbsp;" not in render(Plan({"policy weights": 2**30}, [Phase("update", {"saved activations": 2**30})],
                                       {}, []))


@pytest.mark.parametrize("bug", [ValueError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)"),
                                 RuntimeError("expected scalar type Float but found BFloat16"),
                                 ImportError("cannot import name 'x' from 'emapg.kl'")])
def test_a_bug_shows_its_traceback_not_a_one_line_user_error(bug, monkeypatch, capsys):
    """The CLI prints one line (exit 2) only for an EmapgError, the errors a user causes; a torch shape bug, a
    dtype bug or a broken import inside emapg is not the user's and propagates with its traceback (it used to be
    printed as "emapg: error: ..." like a typo in a config)."""
    from emapg.models import plan

    def broken(*args, **kwargs):
        raise bug

    monkeypatch.setattr(plan, "report", broken)
    with pytest.raises(type(bug), match=str(bug)[:20]):
        main(["plan", "--config", str(SMOKE)])
    assert "emapg: error" not in capsys.readouterr().err


def test_every_error_a_user_causes_is_an_emapg_error():
    """The classes the CLI prints as one line: config, data, checkpoint, metrics, reward, retriever, a missing
    optional package; each still the built-in kind code catches (ValueError, RuntimeError, ImportError)."""
    from emapg.errors import CheckpointError, ConfigError, EmapgError, MissingPackage
    from emapg.retrieval import RetrieverError
    from emapg.run.metrics import MetricsError
    from emapg.tasks.base import RewardError

    for cls, kind in [(ConfigError, ValueError), (DataError, ValueError), (CheckpointError, ValueError),
                      (MetricsError, ValueError), (RewardError, RuntimeError), (RetrieverError, RuntimeError),
                      (MissingPackage, ImportError)]:
        assert issubclass(cls, EmapgError) and issubclass(cls, kind), cls
