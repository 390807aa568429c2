"""bench/publish_run.py: a finished run's published record (what the docs' linked numbers read) is the run's
own numbers, read from its folder in the real layout a training writes."""

import json
import sys
from pathlib import Path

import pytest

from emapg.config import load_config
from emapg.run.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "src" / "emapg" / "recipes" / "smoke.yaml"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    Trainer(load_config(SMOKE, ["steps=4", "eval.every=2", "eval.size=12", "eval.anchor=true"]), out,
            progress=False).train()
    return out


def test_the_record_is_the_runs_own_numbers(run, bench_module):
    record = bench_module("publish_run").run_record(run)
    final = json.loads((run / "eval.json").read_text())
    assert record["policy"] == final["policy"]["accuracy"] and record["anchor"] == final["anchor"]["accuracy"]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    evals = {str(r["step"]): r["eval/policy_accuracy"] for r in rows if "eval/policy_accuracy" in r}
    assert record["policy_by_step"] == evals and set(evals) == {"0", "2", "4"}
    assert record["steps"] == 4
    # the paired test counted from the kept outcomes, problem by problem, at the last evaluation
    kept = [json.loads(x) for x in (run / "outcomes" / "outcomes.jsonl").read_text().splitlines()]
    last = {x["model"]: x["solved"] for x in kept if x["step"] == 4 and x["set"] == "heldout"}
    only_anchor = sum(1 for a, p in zip(last["anchor"], last["policy"], strict=True) if a and not p)
    only_policy = sum(1 for a, p in zip(last["anchor"], last["policy"], strict=True) if p and not a)
    pair = record["anchor_vs_policy"]
    assert (pair["problems"], pair["only_anchor"], pair["only_policy"]) == (12, only_anchor, only_policy)


def test_publishing_adds_one_entry_and_keeps_the_others(run, bench_module, tmp_path, monkeypatch):
    publish = bench_module("publish_run")
    monkeypatch.setattr(publish, "ROOT", tmp_path)
    results = tmp_path / "docs" / "results"
    results.mkdir(parents=True)
    (results / "smoke.json").write_text(json.dumps({"runs": {"earlier": {"policy": 0.5}}}))
    monkeypatch.setattr(sys, "argv", ["publish_run.py", "--run", str(run), "--name", "smoke", "--command",
                                      "emapg train --config smoke", "--key", "today", "--commit", "abc1234"])
    publish.main()
    doc = json.loads((results / "smoke.json").read_text())
    assert doc["runs"]["earlier"] == {"policy": 0.5}
    entry = doc["runs"]["today"]
    assert entry["command"] == "emapg train --config smoke" and entry["commit"] == "abc1234"
    assert entry["policy"] == json.loads((run / "eval.json").read_text())["policy"]["accuracy"]
    assert {"cpu", "cores", "torch"} <= set(entry["machine"])


def test_a_folder_without_a_finished_run_is_one_line(bench_module, tmp_path, monkeypatch):
    publish = bench_module("publish_run")
    monkeypatch.setattr(sys, "argv", ["publish_run.py", "--run", str(tmp_path), "--name", "x", "--command", "c"])
    with pytest.raises(SystemExit, match="no eval.json there"):
        publish.main()
