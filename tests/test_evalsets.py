"""The paper's evaluation sets in their published formats (tests/fixtures/evalsets: hand-written rows in each
exact schema): read, scored, split by source, and evaluated by `emapg eval` in the paper's table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from emapg.data import DataError
from emapg.run.evalsuite import markdown, parse_sets, sets_of
from emapg.tasks import make_task
from emapg.tasks.math import gold_answers, math_rows
from emapg.tasks.search_qa import SEARCH_R1, qa_rows

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "evalsets"


@pytest.mark.parametrize(("name", "problem", "answers"), [
    ("math500.jsonl", "What is $1+2$?", ["3"]),
    ("aime_2024.jsonl", "Find the remainder when $2024$ is divided by $1000$.", ["24"]),
    ("aime_2024_upper.jsonl", "Find the remainder when $2024$ is divided by $1000$.", ["24"]),  # Answer: 24 (int)
    ("aime_2025.jsonl", "Find the number of positive divisors of $12$.", ["6"]),
    ("amc.jsonl", "What is $100+42$?", ["142"]),  # 142.0 in the file
    ("minerva.json", "A star is $10$ parsecs away. How far is it in parsecs?", ["10"]),
    ("olympiadbench.jsonl", "Find the smallest positive integer $n$ with $n^2 > 5$.", ["3"]),  # ["$3$"]
    ("matharena_aime_2025.jsonl", "Find the number of positive divisors of $12$.", ["6"]),  # answer: 6 (int)
    ("livemathbench_amc_en.jsonl", "What is $\\frac{1}{2}+\\frac{1}{4}$? Give your answer as a fraction.",
     ["\\frac{3}{4}"]),  # "$\\frac{3}{4}$"
    ("livemathbench_hard_en.jsonl", "Find the sum of the roots of $x^2 - 7x + 10 = 0$.", ["7"]),
    ("minervamath.jsonl", "A planet orbits at $2$ AU. What is its orbital radius in AU?", ["2"]),
])
def test_each_published_math_format_reads_its_problem_and_answer(name, problem, answers):
    row = math_rows(str(FIXTURES / name), "problem", "answer")[0]
    assert row["problem"] == problem and row["answer"] == answers


def test_matharena_parquet_reads_as_its_jsonl(tmp_path):
    """MathArena publishes parquet (`hf download` gives it): problem_idx and answer as int64, read as the JSONL."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in (FIXTURES / "matharena_aime_2025.jsonl").read_text().splitlines()]
    table = pa.table({"problem_idx": pa.array([r["problem_idx"] for r in rows], pa.int64()),
                      "problem": [r["problem"] for r in rows],
                      "answer": pa.array([r["answer"] for r in rows], pa.int64())})
    pq.write_table(table, tmp_path / "train-00000-of-00001.parquet")
    read = math_rows(str(tmp_path / "train-00000-of-00001.parquet"), "problem", "answer")
    jsonl = math_rows(str(FIXTURES / "matharena_aime_2025.jsonl"), "problem", "answer")
    assert [(r["problem"], r["answer"]) for r in read] == [(r["problem"], r["answer"]) for r in jsonl]
    assert [r["answer"] for r in read] == [["6"], ["24"]]


def test_olympiadbench_list_answers_score_right():
    task = make_task("math", eval_file=str(FIXTURES / "olympiadbench.jsonl"), template="chat")
    single, several = task.eval_examples(2)
    assert single.answer == "3" and several.answer == "2, -2"  # is_multiple_answer: both values are the answer
    assert task.eval_reward("so the answer is \\boxed{3}", single) == 1.0  # was 0: str(["$3$"]) compared
    assert task.eval_reward("\\boxed{4}", single) == 0.0
    assert task.eval_reward("\\boxed{-2, 2}", several) == 1.0 and task.eval_reward("\\boxed{2}", several) == 0.0
    amc = make_task("math", eval_file=str(FIXTURES / "amc.jsonl"))
    first, second = amc.eval_examples(2)
    assert amc.eval_reward("\\boxed{142}", first) == 1.0 and amc.eval_reward("\\boxed{\\frac{1}{4}}", second) == 1.0


def test_gold_answers_and_a_row_without_a_known_column(tmp_path):
    assert gold_answers(["$3$", " 4 "]) == ["3", "4"] and gold_answers(7.0) == ["7"] and gold_answers(0.5) == ["0.5"]
    assert gold_answers(["$1$", "$2$"], together=True) == ["1, 2"] and gold_answers("$$x$$") == ["x"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "p", "answer": "1"}\n{"prompt": "p", "solution": "s"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl, line 2: no problem \(looked for problem, Problem, question"):
        math_rows(str(bad), "problem", "answer")


def test_flashrag_golden_answers_read():
    rows = qa_rows(str(FIXTURES / "nq_test.jsonl"))
    assert [r["answers"] for r in rows] == [["Tessaly Varn", "T. Varn"], ["Dornhaven"]]
    task = make_task("search_qa", eval_file=str(FIXTURES / "nq_test.jsonl"), retriever_url="http://127.0.0.1:9")
    first, second = task.eval_examples(2)
    assert first.answer == ["Tessaly Varn", "T. Varn"]
    # Search-R1's data preparation: the question stripped, a '?' added where it has none
    assert first.messages[0]["content"] == SEARCH_R1.format(question="who wrote the ember sonatas?")
    assert second.messages[0]["content"].endswith("Question: where is quillmarsh abbey?\n")
    assert task.eval_reward("<answer> T. Varn </answer>", first) == 1.0


def write_search_r1_parquet(path: Path, questions: list[tuple[str, str, list[str]]]) -> None:
    """Rows as Search-R1's scripts/data_process/qa_search_test_merge.py writes them (one merged file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    counters: dict[str, int] = {}
    rows = []
    for source, question, answers in questions:
        index = counters.setdefault(source, 0)
        counters[source] += 1
        # FlashRAG's columns stay (the question as FlashRAG has it: the prompt's has a '?' added)
        rows.append({"id": f"test_{index}", "question": question.rstrip("?"), "golden_answers": answers,
                     "data_source": source,
                     "prompt": [{"content": SEARCH_R1.format(question=question), "role": "user"}],
                     "ability": "fact-reasoning",
                     "reward_model": {"ground_truth": {"target": answers}, "style": "rule"},
                     "extra_info": {"index": index, "split": "test"}})
    pq.write_table(pa.Table.from_pylist(rows), path)


QUESTIONS = [("nq", "who wrote the ember sonatas?", ["Tessaly Varn"]),
             ("nq", "where is quillmarsh abbey?", ["Dornhaven"]),
             ("hotpotqa", "which canal carries barges of salt?", ["Brimwater Canal"])]


def test_search_r1_merged_parquet_reads_as_one_set_per_source(tmp_path):
    pytest.importorskip("pyarrow")
    path = tmp_path / "test.parquet"
    write_search_r1_parquet(path, QUESTIONS)
    rows = qa_rows(str(path))
    assert [(r["id"], r["question"], r["answers"]) for r in rows] == [
        ("nq-0", QUESTIONS[0][1], ["Tessaly Varn"]), ("nq-1", QUESTIONS[1][1], ["Dornhaven"]),
        ("hotpotqa-0", QUESTIONS[2][1], ["Brimwater Canal"])]
    task = make_task("search_qa", eval_file=str(path), retriever_url="http://127.0.0.1:9")
    # Search-R1's prompt, as its qa_search_test_merge.py writes it (one line; "your want" is theirs)
    assert task.eval_examples(1)[0].messages[0]["content"] == (
        "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you "
        "get new information. After reasoning, if you find you lack some knowledge, you can call a search engine "
        "by <search> query </search> and it will return the top searched results between <information> and "
        "</information>. You can search as many times as your want. If you find no further external knowledge "
        "needed, you can directly provide the answer inside <answer> and </answer>, without detailed "
        "illustrations. For example, <answer> Beijing </answer>. Question: who wrote the ember sonatas?\n")
    # the prompt emapg builds is the one in the file, byte for byte
    for ex, (_, question, _) in zip(task.eval_examples(3), QUESTIONS, strict=True):
        assert ex.messages[0]["content"] == SEARCH_R1.format(question=question)
    sets = sets_of(task, "test", 100)
    assert [(name, [ex.id for ex in exs]) for name, exs in sets] == [
        ("nq", ["eval-nq-0", "eval-nq-1"]), ("hotpotqa", ["eval-hotpotqa-0"])]
    assert sets_of(task, "test", 2)[0][0] == "test"  # the first two rows: one source, one set


def test_two_models_of_one_folder_name_write_apart():
    from emapg.run.evalsuite import model_labels

    assert model_labels(["runs/a/export/policy"]) == {"runs/a/export/policy": None}
    assert model_labels(["runs/a/export/policy", "runs/a/export/anchor"]) == {
        "runs/a/export/policy": "policy", "runs/a/export/anchor": "anchor"}
    assert model_labels(["runs/a/export/policy", "runs/b/export/policy"]) == {
        "runs/a/export/policy": "a-export-policy", "runs/b/export/policy": "b-export-policy"}


def test_an_empty_answer_is_named(tmp_path):
    f = tmp_path / "olympiad.jsonl"
    f.write_text('{"question": "q", "final_answer": []}\n')
    with pytest.raises(DataError, match=r"olympiad.jsonl, line 1: field 'final_answer': an empty answer"):
        math_rows(str(f), "problem", "answer")


@pytest.mark.parametrize(("row", "message"), [
    ('{"question": "q", "final_answer": [null]}', r"line 1: field 'final_answer': an answer is None"),  # was "None"
    ('{"problem": "q", "answer": null}', r"line 1: field 'answer' is null \(expected the answer\)"),
    ('{"problem": 5, "answer": "1"}', r"line 1: field 'problem' is int, expected text"),
    ('{"problem": "x\\ud83d", "answer": "1"}', r"line 1: field 'problem' or 'answer': not valid Unicode"),
])
def test_a_math_row_no_grader_could_use_is_named(tmp_path, row, message):
    f = tmp_path / "m.jsonl"
    f.write_text(row + "\n")
    with pytest.raises(DataError, match=message):
        math_rows(str(f), "problem", "answer")
    assert math_rows(str(_write(tmp_path / "ok.jsonl", '{"problem": "q", "answer": 1972}')), "problem",
                     "answer")[0]["answer"] == ["1972"]


def _write(path, line):
    path.write_text(line + "\n")
    return path


def test_parse_sets():
    assert parse_sets(None) == [("heldout", None)]
    assert parse_sets(["/d/aime24.jsonl", "amc=/d/x.parquet", "/d/aime24.jsonl", "a=b/c.json"]) == [
        ("aime24", "/d/aime24.jsonl"), ("amc", "/d/x.parquet"), ("aime24-2", "/d/aime24.jsonl"), ("a", "b/c.json")]


def test_the_table_has_a_row_per_model_and_set_and_the_papers_layout():
    """Per model the sets' unweighted average and the reference's aggregate, weighted by problems (30 AIME
    problems at 30%, 90 AMC at 50%: 45% by problems, 40% unweighted)."""
    rows = [{"model": m, "dataset": s, "problems": p, "samples": 8, "num": 8 * p, "accuracy": acc, "pass@8": acc + .1,
             "mean_length": 100.0} for m, s, p, acc in (("policy", "aime24", 30, 0.3), ("policy", "amc", 90, 0.5),
                                                         ("anchor", "aime24", 30, 0.4), ("anchor", "amc", 90, 0.6))]
    md = markdown(rows)
    assert "| policy | aime24 | 30 | 8 | 30.0 | 40.0 | 100 |" in md
    assert "| policy | average |  |  | 40.0 | 50.0 |  |" in md
    assert "| policy | average, by problems | 120 |  | 45.0 | 55.0 |  |" in md
    assert "| model | aime24 | amc | average, by problems | average |" in md
    assert "| anchor | 40.0 | 60.0 | 55.0 | 50.0 |" in md


def test_eval_of_a_merged_search_r1_file_prints_a_row_per_source(tmp_path):
    pytest.importorskip("pyarrow")
    pytest.importorskip("bm25s")
    from emapg.retrieval.bm25 import build_index

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "1", "title": "Tessaly Varn", "text": "Tessaly Varn composed the Ember Sonatas."},
        {"id": "2", "title": "Brimwater Canal", "text": "The Brimwater Canal carries barges of salt."}]))
    build_index(corpus, tmp_path / "index")
    write_search_r1_parquet(tmp_path / "test.parquet", QUESTIONS)
    write_search_r1_parquet(tmp_path / "more.parquet", [QUESTIONS[0], QUESTIONS[2]])
    res = subprocess.run([sys.executable, "-m", "emapg", "eval", "--model", "tiny-llama", "--task", "search_qa",
                          "--task-args", json.dumps({"index": str(tmp_path / "index"), "max_turns": 1,
                                                     "max_turn_tokens": 4, "max_total_tokens": 64}),
                          "--data", str(tmp_path / "test.parquet"), str(tmp_path / "more.parquet"), "--device",
                          "cpu", "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads((tmp_path / "out" / "eval.json").read_text())
    # a second file with the same data_source is a set of its own (it overwrote the first's samples before)
    assert [(r["dataset"], r["problems"]) for r in out["rows"]] == [("nq", 2), ("hotpotqa", 1), ("nq-2", 1),
                                                                   ("hotpotqa-2", 1)]
    assert "| tiny-llama | nq | 2 | 1 |" in res.stdout
    assert "| model | nq | hotpotqa | nq-2 | hotpotqa-2 | average, by problems |" in res.stdout
    assert {p.name for p in (tmp_path / "out").glob("*.samples.jsonl")} == {
        "nq.samples.jsonl", "hotpotqa.samples.jsonl", "nq-2.samples.jsonl", "hotpotqa-2.samples.jsonl"}
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / ".emapg-run").write_text("a run folder of emapg train\n")
    res = subprocess.run([sys.executable, "-m", "emapg", "eval", "--model", "tiny-llama", "--task", "math",
                          "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "run: a run folder, whose eval.json and eval.md are its training's" in res.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "tiny-llama", "--task", "math", "--device", "cuda:0"], "--device cuda:0: no CUDA device"),
    (["--model", "tiny-llama", "--task", "math", "--device", "tpu"],
     "--device: expected auto, cpu, cuda or cuda:N, got 'tpu'"),
    (["--model", "tiny-llama", "--task", "math", "--dtype", "int8"], "--dtype: expected one of float32, bfloat16"),
    (["--model", "tiny-llama", "--task", "math", "--samples", "0", "--top-p", "2", "--backend", "nope"],
     "--backend: expected a backend of emapg.backends.BACKENDS: hf, vllm, got 'nope'; --top-p: must be in (0, 1], "
     "got 2.0; --samples: must be >= 1, got 0"),
    (["--model", "tiny-llama", "--task", "math", "--temperature", "-1"], "--temperature: must be > 0, got -1.0"),
    (["--model", "tiny-llama", "--task", "math", "--plugins", "no_such_plugin_module"],
     "plugins: no_such_plugin_module: No module named 'no_such_plugin_module'"),
    (["--task", "math"], "--model and --task: needed unless --run"),
    (["--run", "nowhere"], "--run nowhere: no config.yaml there"),
    (["--model", "tiny-llama", "--task", "arithmetic", "--task-args", "{digits: 2}"], "--task-args: not JSON"),
])
def test_eval_mistakes_are_one_line(args, message, capsys):
    import torch

    from emapg.cli import main

    if "cuda:0" in args and torch.cuda.is_available():
        pytest.skip("a GPU is visible: cuda:0 is valid here")
    assert main(["eval", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_a_runs_evaluation_takes_its_task_settings_with_the_retriever_given(tmp_path):
    """`emapg eval --run RUN --task-args '{"index": ...}'`: the run's task_args (template, budgets...), its
    retriever replaced by the one given (not two retrievers, which the task refuses)."""
    import argparse

    from emapg.commands import eval_subject
    from emapg.config import load_config, save_config

    root = Path(__file__).resolve().parents[1]
    run = tmp_path / "run"
    (run / "export" / "policy").mkdir(parents=True)
    (run / "export" / "anchor").mkdir(parents=True)
    save_config(load_config(root / "recipes" / "search_cpu.yaml"), run / "config.yaml")
    args = argparse.Namespace(run=str(run), model=None, task=None, task_args='{"index": "wiki-bm25"}',
                              trust_plugins=False)
    models, task, task_args = eval_subject(args)
    assert task == "search_qa" and models == [str(run / "export" / "policy"), str(run / "export" / "anchor")]
    assert task_args["index"] == "wiki-bm25" and "synthetic" not in task_args
    assert task_args["turn_prefix"] == load_config(root / "recipes" / "search_cpu.yaml").task_args["turn_prefix"]
