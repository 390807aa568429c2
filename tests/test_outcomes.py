"""Reading a run's per-problem outcomes back, and the paired test of its anchor against its policy."""

import json

import pytest

from emapg.run.outcomes import anchor_against_policy, final_outcomes


def write_outcomes(run, lines, ids=None):
    (run / "outcomes").mkdir(parents=True)
    (run / "outcomes" / "outcomes.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    if ids is not None:
        (run / "outcomes" / "heldout.ids.json").write_text(json.dumps(ids))


def line(step, model, solved, which="heldout"):
    return {"step": step, "set": which, "model": model, "solved": solved}


def test_the_last_evaluation_of_each_model_is_read_back_with_its_ids_and_step(tmp_path):
    write_outcomes(tmp_path, [line(0, "policy", "0000"), line(10, "policy", "1100"), line(10, "anchor", "1110"),
                              line(10, "policy", "0001", "transfer"), line(5, "anchor", "0000")], ["a", "b", "c", "d"])
    assert final_outcomes(tmp_path, "policy") == (["a", "b", "c", "d"], [1, 1, 0, 0], 10)
    assert final_outcomes(tmp_path, "anchor") == (["a", "b", "c", "d"], [1, 1, 1, 0], 10)
    assert final_outcomes(tmp_path, "policy", "transfer") == ([0, 1, 2, 3], [0, 0, 0, 1], 10)  # no ids kept
    assert final_outcomes(tmp_path, "anchor", "transfer") is None
    assert final_outcomes(tmp_path / "nowhere") is None
    # with several samples a digit counts the solving samples: a problem counts solved once
    write_outcomes(tmp_path / "n", [line(3, "policy", "0290")])
    assert final_outcomes(tmp_path / "n")[1] == [0, 1, 1, 0]


def test_anchor_against_policy_is_the_exact_mcnemar_test_on_the_discordant_problems(tmp_path):
    # 12 problems: both solve 3, only the anchor 6, only the policy 1, neither 2
    anchor, policy = "111" + "111111" + "0" + "00", "111" + "000000" + "1" + "00"
    write_outcomes(tmp_path, [line(30, "policy", policy), line(30, "anchor", anchor)])
    got = anchor_against_policy(tmp_path)
    p = 2 * (1 + 7) / 2**7  # two-sided binomial(7, 1/2) tail at 1
    assert got.startswith("Anchor against policy on the same 12 heldout problems (step 30): only the anchor "
                          "solved 6, only the policy 1; exact McNemar p = ")
    assert float(got.split("p = ")[1].split(" ")[0]) == pytest.approx(p, rel=1e-3)


def test_no_paired_test_without_both_models_at_the_same_step(tmp_path):
    write_outcomes(tmp_path / "one", [line(30, "policy", "1010")])
    write_outcomes(tmp_path / "apart", [line(30, "policy", "1010"), line(20, "anchor", "1111")])
    for run in ("one", "apart", "none"):
        assert anchor_against_policy(tmp_path / run) is None
