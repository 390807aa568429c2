"""Record a finished run's published numbers in one file, the one the README and the docs quote.

    python bench/publish_run.py --run runs/demo --name demo --command "bash scripts/demo.sh"

adds (or replaces) the entry ``--key`` (default: today's date) of ``docs/results/NAME.json``: the final
held-out accuracies (``init``, ``policy``, ``anchor``), each evaluation by step, the paired test of the anchor
against its policy on the same problems, the steps' summed seconds, and where it ran (CPU model, cores,
torch, the commit). The docs link to a value as ``[73.5%](docs/results/demo.json#/runs/KEY/anchor)``, and
``tests/test_numbers.py`` checks every such quote against the file.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from pathlib import Path

from _common import commit, machine

ROOT = Path(__file__).resolve().parents[1]


def run_record(run: Path) -> dict:
    """A finished run's numbers: final accuracies, evaluations by step, anchor against policy, seconds."""
    from emapg.run.metrics import read_metrics
    from emapg.run.outcomes import final_outcomes
    from emapg.stats import mcnemar_p

    final = json.loads((run / "eval.json").read_text())
    rows = read_metrics(run)
    record = {k: v["accuracy"] for k, v in final.items() if isinstance(v, dict) and "accuracy" in v}
    for model in ("policy", "anchor"):
        key = f"eval/{model}_accuracy"
        record[f"{model}_by_step"] = {str(r["step"]): r[key] for r in rows if key in r}
    record["steps"] = max(r["step"] for r in rows)
    record["step_seconds"] = round(sum(r.get("step_seconds", 0.0) for r in rows), 1)
    anchor, policy = final_outcomes(run, "anchor"), final_outcomes(run, "policy")
    if anchor and policy and anchor[2] == policy[2] and len(anchor[1]) == len(policy[1]):
        only_anchor, only_policy, p = mcnemar_p(anchor[1], policy[1])
        record["anchor_vs_policy"] = {"problems": len(anchor[1]), "only_anchor": only_anchor,
                                      "only_policy": only_policy, "mcnemar_p": round(p, 3)}
    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="a finished run folder (its eval.json exists)")
    p.add_argument("--name", required=True, help="docs/results/NAME.json")
    p.add_argument("--command", required=True, help="the command that made the run, as the docs show it")
    p.add_argument("--key", default=dt.date.today().isoformat(), help="the entry's name (default: today)")
    p.add_argument("--note", default="", help="what else a reader must know of this run")
    p.add_argument("--commit", help="the commit the run was made with, when it is not the checkout's HEAD")
    args = p.parse_args()
    run = Path(args.run)
    if not (run / "eval.json").exists():
        raise SystemExit(f"--run {run}: no eval.json there (a finished run writes it at its end)")
    path = ROOT / "docs" / "results" / f"{args.name}.json"
    doc = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    doc["runs"][args.key] = {**run_record(run), "command": args.command, "machine": machine(),
                             "commit": args.commit or commit(), **({"note": args.note} if args.note else {})}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
    print(f"{path.relative_to(ROOT)}: runs/{args.key}: " + ", ".join(
        f"{k} {v:.3f}" for k, v in doc["runs"][args.key].items() if k in ("init", "policy", "anchor")))


if __name__ == "__main__":
    main()
