"""Math answer checking, pass@k, data loading, and a tiny-model math eval end to end."""

import json
import math
import re

import pytest

from emapg.data import DataError, load_rows
from emapg.rewards import last_boxed, math_reward
from emapg.run.evaluate import pass_at_k

# (completion, gold answer, equivalent?)
PAIRS = [
    ("The answer is \\boxed{42}.", "42", True),
    ("\\boxed{42}", "41", False),
    ("So we get \\boxed{\\frac{1}{2}}", "0.5", True),
    ("\\boxed{0.5}", "\\frac12", True),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", True),
    ("\\boxed{0.75}", "\\frac{2}{3}", False),
    ("\\boxed{1,000}", "1000", True),
    ("\\boxed{1000}", "1,000", True),
    ("\\boxed{25}", "025", True),
    ("\\boxed{073}", "73", True),
    ("\\boxed{72}", "073", False),
    ("\\boxed{-3}", "-3", True),
    ("\\boxed{3}", "-3", False),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", True),
    ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{\\sqrt{2}}{2}", True),
    ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}", True),
    ("\\boxed{\\sqrt{3}}", "\\sqrt{12}", False),
    ("\\boxed{\\pi/2}", "\\frac{\\pi}{2}", True),
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)", True),
    ("\\boxed{(3, \\pi/2)}", "\\left( 3, \\frac{\\pi}{2} \\right)", True),
    ("\\boxed{(\\pi/2, 3)}", "\\left( 3, \\frac{\\pi}{2} \\right)", False),
    ("\\boxed{[1, 5)}", "[1,5)", True),
    ("\\boxed{[1, 5]}", "[1,5)", False),
    ("\\boxed{(-\\infty, 2)}", "(-\\infty,2)", True),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", True),
    ("\\boxed{x^2+1}", "(x+1)^2", False),
    ("\\boxed{10\\%}", "10", True),
    ("\\boxed{18 \\text{ dollars}}", "18", True),
    ("\\boxed{5 \\text{ cm}}", "5", True),
    ("\\boxed{\\$18}", "18", True),
    ("\\boxed{2, 3}", "2,3", True),
    ("\\boxed{3, 2}", "2,3", True),
    ("\\boxed{2, 4}", "2,3", False),
    ("\\boxed{\\{1, 2, 3\\}}", "\\{1,2,3\\}", True),
    ("\\boxed{1.5}", "\\frac{3}{2}", True),
    ("\\boxed{1.50}", "1.5", True),
    ("\\boxed{1.49}", "1.5", False),
    ("\\boxed{2^{10}}", "1024", True),
    ("\\boxed{9}", "3^2", True),
    ("First \\boxed{7}, then corrected: \\boxed{8}", "8", True),
    ("First \\boxed{8}, then corrected: \\boxed{7}", "8", False),
    ("\\boxed{\\frac{a}{b}}", "a/b", True),
    ("The final answer is 12.", "12", True),
    ("I don't know.", "12", False),
    ("", "12", False),
    ("\\boxed{}", "12", False),
    ("\\boxed{\\text{(B)}}", "\\text{(B)}", True),
]


@pytest.mark.parametrize("completion,answer,equal", PAIRS)
def test_math_reward_table(completion, answer, equal):
    assert math_reward(completion, answer) == float(equal)


def test_math_reward_does_not_execute_text_and_survives_garbage():
    assert math_reward("\\boxed{__import__('os').system('echo hacked')}", "0") == 0.0
    assert math_reward("\\boxed{" + "(" * 500 + "}", "1") == 0.0
    assert math_reward("\\boxed{\\frac{1}{0}}", "1") == 0.0


def test_math_reward_from_a_worker_thread():
    """math-verify's timeouts need the main thread (signal.alarm); from another thread the reward still scores."""
    import threading

    out = []
    worker = threading.Thread(target=lambda: out.extend([math_reward("so \\boxed{3}", "3"),
                                                         math_reward("so \\boxed{4}", "3")]))
    worker.start()
    worker.join()
    assert out == [1.0, 0.0]


def test_last_boxed_balances_braces():
    assert last_boxed("x \\boxed{\\frac{1}{2}} y \\boxed{a{b}c}") == "a{b}c"
    assert last_boxed("no box") is None
    assert last_boxed("\\boxed{unclosed") is None


def test_last_boxed_is_one_scan_and_equals_matching_from_each_box():
    """Braces are matched in one pass (a runaway completion of 10,000 unclosed boxes took 28-41 s when each box
    was matched by its own scan to the end); on random texts the result equals that per-box scan."""
    import random

    from emapg.rewards.math import closing_brace

    def per_box(text):
        for m in reversed(list(re.finditer(r"\\(?:boxed|fbox)\s*\{", text))):
            end = closing_brace(text, m.end(), depth=1)
            if end is not None:
                return text[m.end():end]
        return None

    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice(["\\boxed{", "\\fbox {", "{", "}", "x", "1", " "]) for _ in range(rng.randrange(30)))
        assert last_boxed(text) == per_box(text), text
    assert last_boxed("\\boxed{" * 10_000 + "\\boxed{7}") == "7"


def test_pass_at_k_hand_computed():
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 4, 2) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))  # 0.5
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - math.comb(3, 3) / math.comb(5, 3))  # 0.9
    assert pass_at_k(10, 3, 10) == 1.0
    with pytest.raises(ValueError, match="at least 3 samples"):
        pass_at_k(2, 1, 3)


def test_loader_reads_jsonl_json_parquet_with_field_mapping(tmp_path):
    rows = [{"question": "1+1?", "final": "2"}, {"question": "2+2?", "final": "4"}]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "a.json").write_text(json.dumps(rows))
    from datasets import Dataset

    Dataset.from_list(rows).to_parquet(str(tmp_path / "a.parquet"))
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    for name in ("a.jsonl", "a.json", "a.parquet", "ds"):
        got = load_rows(tmp_path / name, {"problem": "question", "answer": "final"}, ("problem", "answer"))
        assert [(r["problem"], r["answer"]) for r in got] == [("1+1?", "2"), ("2+2?", "4")], name


def test_loader_errors_name_file_line_and_field(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"problem": "a", "answer": "1"}\n{"problem": "b"\n')
    with pytest.raises(DataError, match=r"bad.jsonl, line 2: malformed JSON"):
        load_rows(f)
    f.write_text('{"problem": "a", "answer": "1"}\n{"problem": "b", "solution": "x"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl, line 2: missing field 'answer'"):
        load_rows(f, {"answer": "answer"})
    f.write_text("")
    with pytest.raises(DataError, match=r"bad.jsonl: no rows"):
        load_rows(f)
    with pytest.raises(DataError, match="does not exist"):
        load_rows(tmp_path / "nope.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unknown format '.csv'"):
        load_rows(tmp_path / "x.csv")


def test_a_train_file_no_larger_than_the_held_out_share_says_why_nothing_trains(tmp_path):
    from emapg.tasks import make_task

    f = tmp_path / "small.jsonl"
    f.write_text("".join(json.dumps({"problem": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(10)))
    with pytest.raises(ValueError, match=r"has 10 rows, and without an eval_file its last eval_size \(500\)"):
        make_task("math", train_file=str(f))
    task = make_task("math", train_file=str(f), eval_size=4)  # the fix the message names
    assert len(task.eval_examples(100)) == 4


def test_tiny_model_math_eval_end_to_end(tmp_path):
    import subprocess
    import sys

    data = tmp_path / "mini.jsonl"
    data.write_text("".join(json.dumps({"id": str(i), "problem": f"What is {i}+{i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(4)))
    res = subprocess.run([sys.executable, "-m", "emapg", "eval", "--model", "tiny-llama", "--task", "math",
                          "--data", str(data), f"again={data}", "--samples", "2", "--temperature", "1.0",
                          "--max-new-tokens", "6", "--device", "cpu", "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert [r["dataset"] for r in out["rows"]] == ["mini", "again"]
    assert out["device"] == "cpu" and out["dtype"] == "float32" and out["backend"] == "hf"
    assert out["rows"][0]["num"] == 8 and out["rows"][0]["problems"] == 4 and "pass@2" in out["rows"][0]
    assert "| tiny-llama | mini | 4 | 2 |" in res.stdout and "| tiny-llama | average |" in res.stdout
    assert "| model | mini | again | average, by problems | average |" in res.stdout  # the paper's layout
    # the transcripts behind each row: every sample, its reward, and the row's accuracy is their mean
    for name, row in (("mini", out["rows"][0]), ("again", out["rows"][1])):
        recs = [json.loads(line) for line in (tmp_path / "out" / f"{name}.samples.jsonl").read_text().splitlines()]
        assert len(recs) == 8 and sorted({r["id"] for r in recs}) == ["eval-0", "eval-1", "eval-2", "eval-3"]
        assert all(f"What is {i}+{i}?" in r["prompt"] and r["answer"] == str(2 * i)
                   for r in recs for i in [int(r["id"].split("-")[1])])
        assert sum(r["reward"] for r in recs) / 8 == pytest.approx(row["accuracy"])


def test_format_reward_adds_to_training_reward_not_to_accuracy(tmp_path):
    from emapg.tasks.math import MathTask

    f = tmp_path / "p.jsonl"
    f.write_text('{"id": "1", "problem": "1+1?", "answer": "2"}\n')
    task = MathTask(eval_file=str(f), format_weight=0.25)
    ex = task.eval_examples(1)[0]
    assert task.reward("so \\boxed{3}", ex) == 0.25  # well formed, wrong
    assert task.reward("so \\boxed{2}", ex) == 1.25  # well formed, right
    assert task.reward("it is 2", ex) == 1.0  # right (the last number counts), no box: no bonus
    assert task.eval_reward("so \\boxed{3}", ex) == 0.0 and task.eval_reward("so \\boxed{2}", ex) == 1.0
    plain = MathTask(eval_file=str(f))
    assert plain.reward("so \\boxed{3}", ex) == 0.0


def test_the_shipped_gsm8k_reads_whole_and_a_gzipped_file_of_yours_reads_too(tmp_path):
    import gzip

    from emapg.tasks import make_task

    train, test = load_rows("emapg:gsm8k_train", required=("problem", "answer")), load_rows("emapg:gsm8k_test")
    assert (len(train), len(test)) == (7473, 1319)  # GSM8K's splits, whole
    assert len({r["id"] for r in train}) == 7473 and train[0]["id"] == "gsm8k_train_0"
    assert train[0]["answer"] == "72" and train[0]["problem"].startswith("Natalia sold clips")
    assert all(re.fullmatch(r"-?\d+(\.\d+)?", r["answer"]) for r in train + test)  # every answer a number
    task = make_task("math", train_file="emapg:gsm8k_train", eval_file="emapg:gsm8k_test")  # the math_cpu recipe's
    assert [ex.answer for ex in task.eval_examples(3)] == [r["answer"] for r in test[:3]]
    with pytest.raises(DataError, match=r"emapg:gsm9k: emapg ships no 'gsm9k'; it ships gsm8k_test, gsm8k_train"):
        load_rows("emapg:gsm9k")
    mine = tmp_path / "mine.jsonl.gz"
    mine.write_bytes(gzip.compress(b'{"problem": "1+1?", "answer": "2"}\n'))
    assert [r["answer"] for r in load_rows(mine)] == ["2"]
    good = gzip.compress(b'{"problem": "1+1?", "answer": "2"}\n' * 50)
    for damaged in (good[:-9], good[:10] + b"\xff" + good[11:]):  # truncated; a reserved deflate block type
        mine.write_bytes(damaged)
        with pytest.raises(DataError, match=r"mine.jsonl.gz: not a readable gzip file"):
            load_rows(mine)


def test_eval_protocol_paper_runs_the_published_sets_with_the_references_settings(tmp_path):
    """`emapg eval --protocol paper`: the reference's sampling (32 samples, T 0.8, top-p 0.9, 28,000 tokens, seed
    429) and grader, on the 7 sets as scripts/paper_evalsets.py writes them from the published-format fixtures
    (the reference's sources: LiveMathBench's AMC sets, MathArena's AIME 2025, math-ai's Minerva); an option
    given wins (here the budget and the samples, a tiny model's context being 2,048 tokens) and is said to differ;
    the aggregate weighs sets by problems."""
    import subprocess
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import paper_evalsets

    # scripts/paper_evalsets.py with the Hub replaced by the published-format fixtures of each source
    sets = Path(__file__).resolve().parent / "fixtures" / "evalsets"
    files = {"HuggingFaceH4/aime_2024": "aime_2024.jsonl", "v202412_AMC_en": "livemathbench_amc_en.jsonl",
             "HuggingFaceH4/MATH-500": "math500.jsonl", "math-ai/minervamath": "minervamath.jsonl",
             "OE_TO_maths_en_COMP": "olympiadbench.jsonl", "MathArena/aime_2025": "matharena_aime_2025.jsonl",
             "v202505_hard_en": "livemathbench_hard_en.jsonl"}
    asked = []

    def hub(repo, config, split, revision):
        asked.append((repo, config, split, revision))
        return [json.loads(line) for line in (sets / files[config or repo]).read_text().splitlines()]

    written = paper_evalsets.fetch(tmp_path / "eval", hub, {"aime2025": "abc123"})
    assert [n for n, _, _ in written] == list(paper_evalsets.SETS) and len(written) == 7
    assert asked[5] == ("MathArena/aime_2025", None, "train", "abc123")
    data = [f"{name}={path}" for name, _, path in written]
    res = subprocess.run([sys.executable, "-m", "emapg", "eval", "--protocol", "paper", "--model", "tiny-llama",
                          "--task", "math", "--data", *data, "--samples", "2", "--max-new-tokens", "8",
                          "--device", "cpu", "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert (out["protocol"], out["temperature"], out["top_p"], out["seed"], out["grader"]) == (
        "paper", 0.8, 0.9, 429, "reference")
    assert out["samples"] == 2 and out["max_new_tokens"] == 8
    assert "--samples 2: not the paper's protocol (32)" in res.stderr
    assert "sends seed 429 with each of its 32 requests" in res.stderr  # the protocol says how it differs
    assert len(out["rows"]) == 7 and "average, by problems" in res.stdout
    total = sum(r["problems"] for r in out["rows"])
    assert f"| tiny-llama | average, by problems | {total} |" in res.stdout
    bad = subprocess.run([sys.executable, "-m", "emapg", "eval", "--protocol", "paper", "--model", "tiny-llama",
                          "--task", "math"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--protocol paper: give the paper's sets with --data" in bad.stderr


def test_eval_on_two_processes_gives_the_table_of_one(tmp_path):
    """`torchrun --nproc_per_node 2 -m emapg eval`: each process decodes every other problem; greedy, the rows
    (accuracy, lengths, counts) and every transcript equal one process's; the table is printed once."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    sets = Path(__file__).resolve().parent / "fixtures" / "evalsets"
    args = ["eval", "--model", "tiny-llama", "--task", "math", "--data", f"ds={sets / 'deepscaler_train.json'}",
            f"math500={sets / 'math500.jsonl'}", "--max-new-tokens", "8", "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, "-m", "emapg", *args, "--out", str(tmp_path / "one")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                          "emapg", *args, "--out", str(tmp_path / "two")], env=env, capture_output=True, text=True,
                         timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("| tiny-llama | ds |") == 1 and two.stdout.count("| model | set |") == 1  # rank 0 prints
    a, b = (json.loads((tmp_path / w / "eval.json").read_text())["rows"] for w in ("one", "two"))
    assert [(r["dataset"], r["problems"], r["num"]) for r in a] == [(r["dataset"], r["problems"], r["num"]) for r in b]
    for ra, rb in zip(a, b, strict=True):
        assert rb["accuracy"] == pytest.approx(ra["accuracy"]) and rb["mean_length"] == pytest.approx(ra["mean_length"])
    for name in ("ds", "math500"):
        def completions(w, name=name):
            rows = [json.loads(line) for line in (tmp_path / w / f"{name}.samples.jsonl").read_text().splitlines()]
            return sorted((r["id"], r["completion"]) for r in rows)
        assert completions("two") == completions("one") and len(completions("one")) > 1


def test_reference_seeding_reads_one_sample_a_problem_as_the_references_n_same_seed_samples(tmp_path):
    """--seeding reference: the reference's engine sends one seed with each of a problem's requests, so its n
    samples are one sample repeated: one sample a problem, counted n times (avg@n equals that sample's accuracy,
    pass@k equals pass@1, every record n times); the default draws n independent samples."""
    from emapg.cli import main

    common = ["eval", "--model", "tiny-llama", "--task", "arithmetic", "--task-args", '{"digits": 1}', "--size", "12",
              "--temperature", "1.0", "--max-new-tokens", "4", "--device", "cpu", "--seed", "5"]
    assert main([*common, "--samples", "1", "--out", str(tmp_path / "one")]) == 0
    assert main([*common, "--samples", "4", "--seeding", "reference", "--out", str(tmp_path / "ref")]) == 0
    assert main([*common, "--samples", "4", "--out", str(tmp_path / "ind")]) == 0
    one, ref, ind = (json.loads((tmp_path / d / "eval.json").read_text()) for d in ("one", "ref", "ind"))
    (r1,), (rr,), (ri,) = one["rows"], ref["rows"], ind["rows"]
    assert ref["seeding"] == "reference" and rr["samples"] == 4 and rr["accuracy"] == r1["accuracy"]
    assert ind["seeding"] == "independent" and ri["samples"] == 4
    assert rr["pass@4"] == rr["pass@2"] == rr["pass@1"] == r1["pass@1"]
    def records(folder):
        (file,) = (tmp_path / folder).glob("*.samples.jsonl")
        return [json.loads(x) for x in file.read_text().splitlines()]

    samples, independent = records("ref"), records("ind")
    assert len(samples) == 12 * 4 and all(samples[4 * i: 4 * i + 4] == [samples[4 * i]] * 4 for i in range(12))
    assert any(len({s["completion"] for s in independent[4 * i: 4 * i + 4]}) > 1 for i in range(12))
