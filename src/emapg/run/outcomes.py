"""A run's per-problem outcomes, read back: what :class:`emapg.run.evaluate.RunEvaluator` streams to
``RUN/outcomes/`` (a line of 0/1 digits per evaluation, in the order of ``SET.ids.json``), and the paired
test of the run's anchor against its own policy on the same problems."""

from __future__ import annotations

import json
from pathlib import Path

from emapg.errors import EmapgError, regular_file
from emapg.stats import mcnemar_p


def final_outcomes(run: Path, model: str = "policy", which_set: str = "heldout",
                   ) -> tuple[list, list[int], int] | None:
    """A run's last evaluation of ``model`` on ``which_set``, problem by problem: (the set's problem ids,
    0/1 per problem, the step), or None for a run that kept none."""
    run = Path(run)
    path, ids = run / "outcomes" / "outcomes.jsonl", run / "outcomes" / f"{which_set}.ids.json"
    if not path.exists():
        return None
    try:
        regular_file(path)
        lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        mine = [x for x in lines if x["model"] == model and x["set"] == which_set]
        if not mine:
            return None
        last = max(mine, key=lambda x: x["step"])
        solved = [min(1, int(c)) for c in last["solved"]]
        if ids.exists():
            regular_file(ids)
        known = json.loads(ids.read_text()) if ids.exists() else list(range(len(solved)))
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise EmapgError(f"{path.parent}: damaged outcomes ({type(e).__name__}: {e}); remove the folder to leave "
                         "this run's problem-by-problem comparison out") from None
    return known, solved, last["step"]


def anchor_against_policy(run: Path, which_set: str = "heldout", model: str = "anchor") -> str | None:
    """One sentence: the run's last evaluations of the anchor (``model``: or its weight EMA, "ema") and of the
    policy on the same problems, paired (exact McNemar); None unless both were kept at the same step."""
    anchor, policy = final_outcomes(run, model, which_set), final_outcomes(run, "policy", which_set)
    if anchor is None or policy is None or anchor[2] != policy[2] or len(anchor[1]) != len(policy[1]):
        return None
    only_anchor, only_policy, p = mcnemar_p(anchor[1], policy[1])
    name = {"anchor": "anchor", "ema": "weight EMA"}.get(model, model)
    return (f"{name[0].upper() + name[1:]} against policy on the same {len(anchor[1])} {which_set} problems (step "
            f"{anchor[2]}): only the {name} solved {only_anchor}, only the policy {only_policy}; exact McNemar p = "
            f"{p:.3g} (two-sided).")
