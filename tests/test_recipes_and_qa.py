import inspect
from pathlib import Path

import pytest

from emapg.config import load_config
from emapg.kl import ESTIMATORS
from emapg.rewards import normalize_answer, qa_em, qa_f1
from emapg.tasks import TASKS

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_loads_and_validates(recipe):
    cfg = load_config(recipe)  # validation ran: the estimator, form, ranges and task are known
    assert cfg.steps > 0 and cfg.algo.kl in ESTIMATORS and cfg.task in TASKS
    # every task argument is one the task takes (building it would need the search recipes' files)
    assert set(cfg.task_args) <= set(inspect.signature(TASKS[cfg.task]).parameters)


def test_math_recipe_is_the_papers_setup():
    cfg = load_config(Path(__file__).resolve().parents[1] / "recipes" / "math_r1_distill_1p5b.yaml")
    a = cfg.algo
    assert (a.eta, a.ema_every, a.beta, a.eps_low, a.eps_high, a.dual_clip, cfg.rollout.n) == (
        0.95, 10, 0.001, 0.2, 0.28, 3.0, 8)
    assert a.kl == "topk_reverse" and a.agg == "seq-mean-token-mean" and cfg.lr == 1e-6


def test_qa_normalisation_em_and_f1():
    assert normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert qa_em("the Eiffel tower.", ["Eiffel Tower", "Tour Eiffel"]) == 1.0
    assert qa_em("Paris, France", ["Paris"]) == 0.0
    assert qa_em("An apple", "apple") == 1.0
    assert qa_f1("Paris, France", ["Paris"]) == pytest.approx(2 * 0.5 * 1 / 1.5)
    assert qa_f1("London", ["Paris", "london"]) == 1.0
    assert qa_f1("", ["Paris"]) == 0.0
    assert qa_f1("the", ["a"]) == 1.0  # both normalise to empty
