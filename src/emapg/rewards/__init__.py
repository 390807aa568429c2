"""Reward functions: math answer equivalence and QA exact match / F1."""

from emapg.rewards.math import boxed_format_reward, last_boxed, math_reward
from emapg.rewards.qa import normalize_answer, qa_em, qa_f1

__all__ = ["boxed_format_reward", "last_boxed", "math_reward", "normalize_answer", "qa_em", "qa_f1"]
