"""Does the search agent's RL get signal at step 1? The scaffolds of recipes/search_cpu.yaml measured
against each other on SmolLM2-135M-Instruct, over the generated two-hop knowledge base.

For each scaffold: the step-1 rollout of --prompts training questions x n episodes (sampled, as RL
sees it) gives the share of groups with no signal (every reward equal), the mean reward without
the format bonus (exact match), searches per episode and the bridge hit rate (the second-hop
passage retrieved); then greedy exact match on --held-out held-out one-hop and two-hop questions.

    python bench/search_signal.py --prompts 16 --held-out 100
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "search_cpu.yaml"
# name -> (what it is, overrides of the recipe's task_args and rollout)
SCAFFOLDS = {
    "first-prefix": ("<search> opens the first turn only; <answer> forced after 2 searches", []),
    "turn-prefix": ("<search> opens every turn while searches remain; <answer> forced after 2",
                    ["task_args.turn_prefix=<search>"]),
    "turn-prefix-3psg": ("as turn-prefix, 3 passages per search", ["task_args.turn_prefix=<search>",
                                                                     "task_args.passages=3",
                                                                     "task_args.max_info_tokens=160",
                                                                     "task_args.max_total_tokens=400"]),
    "mix-0.5": ("as turn-prefix, half the training questions one-hop",
                ["task_args.turn_prefix=<search>", "task_args.hops=mix", "task_args.one_hop_frac=0.5"]),
    "turn-prefix-t0.7": ("as turn-prefix, sampling temperature 0.7", ["task_args.turn_prefix=<search>",
                                                                      "rollout.temperature=0.7"]),
    "turn-prefix-t0.5": ("as turn-prefix, sampling temperature 0.5", ["task_args.turn_prefix=<search>",
                                                                      "rollout.temperature=0.5"]),
}


def measure(name: str, overrides: list[str], prompts: int, n: int, held_out: int) -> dict:
    import torch

    from emapg.config import load_config
    from emapg.rollout.sampling import SamplingSpec
    from emapg.run.evaluate import evaluate
    from emapg.run.trainer import Trainer, step_seed
    from emapg.tasks import make_task
    from emapg.tasks.base import score_completions

    cfg = load_config(RECIPE, ["steps=1", "eval.size=0", "save_every=0", "export=false", f"prompts_per_step={prompts}",
                               f"micro_batch_prompts={prompts}", f"rollout.n={n}", *overrides])
    with tempfile.TemporaryDirectory() as out:
        tr = Trainer(cfg, out, progress=False)
        torch.manual_seed(cfg.seed)
        batch = tr.rollout(1)
        examples = tr.run.task.train_examples(__import__("random").Random(step_seed(tr.run.cfg.seed, 1)), prompts)
        em = score_completions(tr.run.task, batch.completions, examples, n, evaluation=True)
        groups = em.view(-1, n)
        two_hop = torch.tensor([len(e.meta.get("support", [])) == 2 for e in examples])
        row = {"no_signal": float((groups.max(1).values == groups.min(1).values).float().mean()),
               "no_signal_two_hop": float((groups.max(1).values == groups.min(1).values)[two_hop].float().mean())
               if two_hop.any() else float("nan"),
               "em": float(em.mean()), "searches": float(batch.stats["searches"].mean()),
               "bridge_hit": float(batch.stats["bridge_hit"].mean()) if "bridge_hit" in batch.stats else float("nan")}
        for hops in ("one", "two") if held_out else ():
            args = {**cfg.task_args, "eval_hops": hops, "hops": "two"}
            task = make_task(cfg.task, **args)
            res = evaluate(tr.run.model, tr.run.tokenizer, task, task.eval_examples(held_out),
                           SamplingSpec(greedy=True))
            row[f"held_{hops}"] = res["accuracy"]
            row[f"held_{hops}_searches"] = res.get("searches_mean", float("nan"))
            row[f"held_{hops}_bridge"] = res.get("bridge_hit_mean", float("nan"))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--held-out", type=int, default=100)
    p.add_argument("--only", nargs="*", default=list(SCAFFOLDS), choices=list(SCAFFOLDS))
    args = p.parse_args()
    rows = {}
    for name in args.only:
        rows[name] = measure(name, SCAFFOLDS[name][1], args.prompts, args.n, args.held_out)
        print(name, rows[name], flush=True)
    print(f"\nstep-1 rollout: {args.prompts} training questions x {args.n} episodes (sampled); held-out: "
          f"{args.held_out} one-hop and {args.held_out} two-hop questions (greedy)\n")
    for r in rows.values():
        for key in ("held_one", "held_two", "held_two_searches", "held_two_bridge"):
            r.setdefault(key, float("nan"))
    print("| scaffold | groups with no signal | two-hop groups with no signal | EM (sampled) | searches | "
          "bridge hit | held-out one-hop EM | held-out two-hop EM | two-hop searches | two-hop bridge hit |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        cells = [f"{name}: {SCAFFOLDS[name][0]}", f"{r['no_signal']:.2f}", f"{r['no_signal_two_hop']:.2f}",
                 f"{r['em']:.3f}", f"{r['searches']:.2f}", f"{r['bridge_hit']:.2f}", f"{100 * r['held_one']:.1f}%",
                 f"{100 * r['held_two']:.1f}%", f"{r['held_two_searches']:.2f}", f"{r['held_two_bridge']:.2f}"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
