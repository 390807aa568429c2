"""The paper's math grader (task_args.grader: reference): each rule of the reference code's reward (rLLM's
RewardMathFn and math_utils at LunjunZhang/ema-pg f9b9776), on hand-written responses. Each expected score is
what the reference's code gives (the equivalence table was run against the reference's own utils.py)."""

import json

import pytest
import torch

from emapg.rewards.math import math_reward
from emapg.rewards.math_reference import extract_answer, graded_text, reference_math_reward
from emapg.tasks import make_task
from emapg.tasks.base import score_completions


def boxed(answer: str) -> str:
    return f"<think>some reasoning</think>The answer is \\boxed{{{answer}}}."


# (answer, gold, the reference's verdict)
EQUIVALENCE = [
    ("0.5", "\\frac12", True), ("0.5", "1/2", True), ("0.75", "3/4", True), ("5.", "5", True),
    ("1,000", "1000", True), ("1000", "1,000", True), ("x = 5", "5", True), ("50\\%", "50", True),
    ("$5$", "5", True), ("30^\\circ", "30", True), ("30 degrees", "30", True), ("\\left(1,2\\right)", "(1,2)", True),
    ("5 \\text{ cm}", "5", True), ("2 \\text{ or } -2", "2,-2", True), ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}", True),
    ("7 3/4", "31/4", True), ("4.0", "4", True), ("\\dfrac{3}{4}", "\\frac{3}{4}", True),
    ("2/4", "1/2", False),  # two fractions: equal only as written
    ("2*2", "4", False),  # an integer against a non-integer expression
    ("\\pi", "3.14159", False), ("(2,1)", "(1,2)", False), ("(1,2)", "(1,2]", False), ("2,-2", "-2,2", False),
    ("6", "7", False),
]


@pytest.mark.parametrize(("answer", "gold", "equal"), EQUIVALENCE)
def test_equivalence_as_the_reference_decides(answer, gold, equal):
    assert reference_math_reward(boxed(answer), gold) == float(equal)


def test_the_graded_text_is_after_the_one_think_end():
    assert graded_text("plan</think> final") == "final"
    assert graded_text("  no think at all  ") == "no think at all"
    assert graded_text("a</think>b</think>c") == "b"  # two or more: between the first and the second
    # a boxed answer inside the thinking only: the text after </think> has none -> 0 (lenient finds it: 1)
    inside = "<think>so \\boxed{12}</think>The answer is twelve."
    assert reference_math_reward(inside, "12") == 0.0 and math_reward(inside, "12") == 1.0
    assert reference_math_reward("a</think>\\boxed{7}</think>\\boxed{8}", "7") == 1.0
    assert reference_math_reward("a</think>\\boxed{7}</think>\\boxed{8}", "8") == 0.0
    # no </think> (a model that does not think aloud): the whole response is searched
    assert reference_math_reward("Thus \\boxed{12}.", "12") == 1.0


def test_a_boxed_answer_is_required_and_read_as_the_reference_reads_it():
    # the right number without a box (a trace cut short, or plain text): 0; lenient reads the number: 1
    plain = "<think>long thought</think> so the answer is 12"
    assert reference_math_reward(plain, "12") == 0.0 and math_reward(plain, "12") == 1.0
    assert extract_answer("\\boxed{3} then \\boxed{4}") == "4"  # the last box
    assert extract_answer("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"  # braces matched
    assert extract_answer("\\boxed 5") is None and extract_answer("\\boxed {5}") is None  # \boxed{ exactly
    assert extract_answer("\\boxed{5") is None and extract_answer("\\fbox{3}") is None
    assert extract_answer("\\boxed{5}\\fbox{6}") == "5"
    assert extract_answer("x <|begin_of_box|> 9 <|end_of_box|> \\boxed{4}") == "9"  # GLM's markers first
    assert reference_math_reward("", "1") == 0.0
    assert reference_math_reward(boxed("12"), "\\boxed{12}") == 1.0  # a gold holding a box: its content


def test_a_list_answer_is_alternatives_and_a_truncated_response_scores_zero(tmp_path):
    """OlympiadBench's is_multiple_answer row ["$2$", "$-2$"]: the reference takes either element (emapg's
    lenient grader wants both, as one answer); a response that ran out of tokens scores 0 under the reference."""
    data = tmp_path / "olympiad.jsonl"
    data.write_text(json.dumps({"id": 1, "question": "Solve $x^2=4$.", "final_answer": ["$2$", "$-2$"],
                                "is_multiple_answer": True}) + "\n")
    reference = make_task("math", eval_file=str(data), grader="reference")
    lenient = make_task("math", eval_file=str(data), grader="lenient")
    ex_ref, ex_len = reference.eval_examples(1)[0], lenient.eval_examples(1)[0]
    assert reference.eval_reward(boxed("-2"), ex_ref) == 1.0 and reference.eval_reward(boxed("2"), ex_ref) == 1.0
    assert lenient.eval_reward(boxed("-2"), ex_len) == 0.0 and lenient.eval_reward(boxed("2, -2"), ex_len) == 1.0
    completions = [boxed("2"), boxed("2")]
    cut = torch.tensor([False, True])
    assert score_completions(reference, completions, [ex_ref], 2, evaluation=True, truncated=cut).tolist() == [1.0, 0.0]
    assert score_completions(lenient, completions, [ex_len], 2, evaluation=True, truncated=cut).tolist() == [0.0, 0.0]
    assert score_completions(lenient, [boxed("2, -2")] * 2, [ex_len], 2, truncated=cut).tolist() == [1.0, 1.0]


def test_a_hostile_answer_is_bounded_and_never_executed():
    # sympy's simplification is bounded in time; an expression the reference deems unsafe is not evaluated
    assert reference_math_reward(boxed("x^{99999999}"), "1") == 0.0
    assert reference_math_reward(boxed("__import__('os').system('echo hi')"), "0") == 0.0


def reference_reward(action: str, ground_truth) -> float:
    """The reference's RewardMathFn (rLLM, LunjunZhang/ema-pg math/rllm/rewards/math_reward.py) around its grading
    function: the gold as its row holds it, each item ``str()``-ed, a boxed one read from its box; nothing else
    done to it."""
    truths = [ground_truth] if isinstance(ground_truth, str | float | int) else list(ground_truth)
    forms = []
    for truth in map(str, truths):
        forms += [extract_answer(truth)] if "\\boxed" in truth else [truth]
    return max((reference_math_reward(action, form) for form in forms if form is not None), default=0.0)


# OlympiadBench (final_answer: a list of $-wrapped LaTeX), LiveMathBench's AMC (a $-wrapped string) and AMC
# (aimo-validation-amc: a float) rows; the first two the reference grades 0 against the gold as written, where a
# loader stripping the dollars graded 1
ROWS = [
    ({"question": "Solve for x.", "final_answer": ["$7$"]}, "\\boxed{x = 7}"),
    ({"question": "How much?", "answer": "$7$"}, "\\boxed{7 \\text{ dollars}}"),
    ({"question": "Roots?", "final_answer": ["$2$, $-2$"], "is_multiple_answer": True}, "\\boxed{2 \\text{ and } -2}"),
    ({"problem": "AMC", "answer": 142.0}, "\\boxed{142}"),
    ({"problem": "AMC", "answer": 142.5}, "\\boxed{142.5}"),
    ({"question": "Plain.", "final_answer": ["$\\frac{1}{2}$"]}, "\\boxed{\\frac12}"),
]


@pytest.mark.parametrize("row,answer", ROWS)
def test_under_the_reference_grader_a_gold_is_graded_as_its_file_holds_it(tmp_path, row, answer):
    """Eval and training grade each row's gold exactly as the reference's reward reads it (no `$` stripped, a float
    as str() writes it): equal to the reference's function on the raw row, for the held-out and the training
    rewards."""
    data = tmp_path / "set.jsonl"
    data.write_text(json.dumps(row) + "\n")
    task = make_task("math", eval_file=str(data), train_file=str(data), grader="reference")
    (ex,) = task.eval_examples(1)
    gold = row.get("final_answer", row.get("answer"))
    response = f"Thinking.</think>So {answer}."
    assert task.eval_reward(response, ex) == task.reward(response, ex) == reference_reward(response, gold)


def test_the_loader_no_longer_rewrites_golds_the_reference_grades_zero(tmp_path):
    """The cases that a loader stripping `$` graded 1 and the reference grades 0 (measured side by side): each is 0."""
    data = tmp_path / "set.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r, _ in ROWS[:2]))
    task = make_task("math", eval_file=str(data), train_file=str(data), grader="reference")
    for ex, (_, answer) in zip(task.eval_examples(2), ROWS[:2], strict=True):
        assert task.eval_reward(f"</think>{answer}", ex) == 0.0
        assert reference_math_reward(f"</think>{answer}", ex.answer.strip("$") if isinstance(ex.answer, str)
                                     else [a.strip("$") for a in ex.answer]) == 1.0  # what the stripped gold gave


def test_a_gold_the_reference_cannot_match_is_kept_with_a_warning_not_the_file_refused(tmp_path, capsys):
    data = tmp_path / "set.jsonl"
    rows = [{"problem": "a", "answer": "$ $"}, {"problem": "b", "answer": "\\boxed{}"}, {"problem": "c", "answer": "3"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = make_task("math", eval_file=str(data), grader="reference")
    assert len(task.eval_examples(10)) == 3
    assert "2 row(s) whose answer the reference grader reads as nothing (no closed \\boxed, or a form that " \
        "normalises to nothing)" in capsys.readouterr().err
    assert reference_math_reward("</think>\\boxed{}", "\\boxed{}") == 1.0  # as the reference: said in the warning
    with pytest.raises(Exception, match="an empty answer|has nothing the lenient grader can match"):  # emapg's own
        make_task("math", eval_file=str(data))
