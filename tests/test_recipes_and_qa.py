import json
from pathlib import Path

import pytest

from emapg.config import load_config
from emapg.rewards import normalize_answer, qa_em, qa_f1
from emapg.tasks import make_task

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
METHOD = ROOT / "docs" / "METHOD.md"  # the method and the paper's setups, in the project's words


def stand_in(path: str, tmp_path: Path) -> str:
    """A file in the schema of a data file a recipe names but this machine lacks (the GPU recipes'
    /path/to placeholders): DeepScaleR's JSON list, a {problem, answer} JSONL, AIME 2024's rows, or
    Search-R1's merged parquet; the fixtures are the published schemas (tests/fixtures/evalsets)."""
    from test_evalsets import QUESTIONS, write_search_r1_parquet

    evalsets = ROOT / "tests" / "fixtures" / "evalsets"
    name = Path(path).name
    if name.endswith(".parquet"):
        out = tmp_path / name
        write_search_r1_parquet(out, QUESTIONS)
        return str(out)
    if "aime" in name:
        return str(evalsets / "aime_2024.jsonl")
    return str(evalsets / ("minerva.json" if name.endswith(".json") else "math500.jsonl"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_builds_its_task_from_its_task_args(recipe, tmp_path, monkeypatch):
    """What load_config cannot check: the task accepts the recipe's task_args (names, types, the
    values it validates: templates, reward kinds, sources), as make_task builds it for a run, and gives
    training and held-out examples. A data file the recipe names that this machine lacks (the GPU
    recipes' /path/to placeholders) is replaced by one in the same published schema (stand_in)."""
    import random

    monkeypatch.setenv("EMAPG_CACHE", str(tmp_path))  # search_cpu's synthetic knowledge base
    cfg = load_config(recipe)
    assert cfg.steps > 0  # load_config accepts 0 steps
    args = dict(cfg.task_args)
    for key in ("train_file", "eval_file"):
        if isinstance(args.get(key), str) and args[key].startswith("/") and not Path(args[key]).exists():
            args[key] = stand_in(args[key], tmp_path)
    task = make_task(cfg.task, **args)
    assert task.eval_examples(1) and task.train_examples(random.Random(0), 2)


# The paper's setups, each number as docs/METHOD.md sections 2 and 6 state it (the phrase is that text's,
# checked against it): the recipes must match them.
PAPER = {
    "math_r1_distill_1p5b.yaml": [
        ("rollout.n", 8, "n = 8"), ("prompts_per_step", 128, "128 prompts per step"), ("lr", 1e-6, "lr 1e-6"),
        ("algo.eps_low", 0.2, "clip 0.2 / 0.28"), ("algo.eps_high", 0.28, "clip 0.2 / 0.28"),
        ("algo.dual_clip", 3.0, "dual clip 3"), ("algo.agg", "seq-mean-token-mean", "seq-mean-token-mean"),
        ("rollout.temperature", 1.0, "temperature 1.0"), ("rollout.max_new_tokens", 8192, "responses of 8k"),
        ("algo.eta", 0.95, "eta = 0.95"), ("algo.ema_every", 10, "ema_every = 10"),
        ("algo.beta", 0.001, "beta = 0.001"),
    ],
    "search_qwen2p5_3b.yaml": [
        ("prompts_per_step", 512, "512 prompts x 5 responses"), ("rollout.n", 5, "512 prompts x 5 responses"),
        ("lr", 1e-6, "lr 1e-6"), ("algo.kl", "topk_reverse", "top-k reverse KL, k = 32"),
        ("algo.k", 32, "top-k reverse KL, k = 32"), ("algo.eta", 0.9, "eta = 0.9,"),
        ("algo.beta", 0.001, "beta = 0.001"), ("algo.ema_every", 10, "ema_every = 10"),
        ("task_args.max_turns", 4, "at most 4 turns"), ("task_args.passages", 3, "top-3 passages"),
        ("task_args.reward", "em", "Reward = exact match"),
    ],
}


@pytest.mark.parametrize("recipe", sorted(PAPER))
def test_the_gpu_recipes_are_the_papers_setups(recipe):
    cfg = load_config(ROOT / "recipes" / recipe)
    method = " ".join(METHOD.read_text().split())  # lines joined: phrases may wrap
    for field, want, phrase in PAPER[recipe]:
        section, _, name = field.rpartition(".")
        node = getattr(cfg, section) if section else cfg
        got = node[name] if isinstance(node, dict) else getattr(node, name)
        assert got == want, f"{recipe}: {field} = {got!r}, the paper's is {want!r} ({phrase!r})"
        assert phrase in method, f"docs/METHOD.md no longer says {phrase!r}"


def test_a_retriever_named_on_the_command_line_replaces_the_recipes():
    cpu = load_config(ROOT / "recipes" / "search_cpu.yaml", ["task_args.retriever_url=http://127.0.0.1:8000/retrieve"])
    assert cpu.task_args["retriever_url"] == "http://127.0.0.1:8000/retrieve" and "synthetic" not in cpu.task_args
    gpu = load_config(ROOT / "recipes" / "search_qwen2p5_3b.yaml", ["task_args.index=/data/wiki-index"])
    assert gpu.task_args["index"] == "/data/wiki-index" and "retriever_url" not in gpu.task_args
    kept = load_config(ROOT / "recipes" / "search_cpu.yaml", ["task_args.max_turns=2"])
    assert "synthetic" in kept.task_args  # other task_args leave the retriever alone


def test_qa_normalisation_em_and_f1():
    assert normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert qa_em("the Eiffel tower.", ["Eiffel Tower", "Tour Eiffel"]) == 1.0
    assert qa_em("Paris, France", ["Paris"]) == 0.0
    assert qa_em("An apple", "apple") == 1.0
    assert qa_f1("Paris, France", ["Paris"]) == pytest.approx(2 * 0.5 * 1 / 1.5)
    assert qa_f1("London", ["Paris", "london"]) == 1.0
    assert qa_f1("", ["Paris"]) == 0.0
    # a prediction that normalises to nothing earns nothing, even against a gold that does too (the SQuAD
    # script would give 1: an empty <answer> </answer> would then be right for a gold "the")
    assert qa_f1("the", ["a"]) == 0.0 and qa_em("", ["the"]) == 0.0 and qa_em(" . ", ["The."]) == 0.0


@pytest.mark.parametrize(("answers", "message"), [
    ([], r"q.jsonl, line 1: field 'golden_answers': no gold answers \(an empty list\)"),
    ([None], r"q.jsonl, line 1: field 'golden_answers': an answer is None \(NoneType\)"),
    (["the", "."], r"every gold answer \('the', '.'\) normalises to nothing"),
    ([["nested"]], r"an answer is \['nested'\] \(list\)"),
])
def test_gold_answers_no_prediction_could_match_are_refused_at_load(tmp_path, answers, message):
    from emapg.data import DataError
    from emapg.tasks.search_qa import qa_rows

    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"id": 1, "question": "who?", "golden_answers": answers}) + "\n")
    with pytest.raises(DataError, match=message):
        qa_rows(str(path))


def test_gold_answers_numbers_and_empty_forms(tmp_path):
    from emapg.tasks.search_qa import qa_rows

    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"id": 1, "question": "when?", "golden_answers": [1972, "The", "MCMLXXII"]}) + "\n"
                    + json.dumps({"id": 2, "question": "x\ud83d?", "golden_answers": ["a b"]}) + "\n")
    from emapg.data import DataError

    with pytest.raises(DataError, match=r"q.jsonl, line 2: field 'question' or 'golden_answers': not valid Unicode"):
        qa_rows(str(path))
    path.write_text(path.read_text().splitlines()[0] + "\n")
    assert qa_rows(str(path))[0]["answers"] == ["1972", "MCMLXXII"]  # the int read as text; "The" dropped
