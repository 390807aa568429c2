"""The KL estimators on real LLM distributions: bias and gradient variance of every estimator, exact.

Positions: responses sampled (temperature 1) by SmolLM2-135M-Instruct policies from real EMA-PG
checkpoints, on two-digit-addition and GSM8K prompts. Three (policy, anchor) pairs:

  early    the policy after 10 steps of the demo against the initial model (a frozen anchor)
  trained  the policy after 30 steps against its EMA anchor (eta 0.9)
  distill  on-policy distillation (``--teacher``): the initial model as the student against a teacher
           (e.g. the demo's exported anchor), the KL the student is trained on with algo.teacher

At every position, over the sampled token p ~ pi, each estimator's expected value, expected
gradient in the policy logits and gradient variance are computed exactly over the full vocabulary
(emapg.kl_moments: closed forms in O(V), checked against enumeration by a test), and compared
with the exact KL and its exact gradient. Reported per estimator (and k for the top-k ones):

  value bias        sum_i (E f_i - KL_i) / sum_i KL_i over the positions
  grad bias         ||sum of per-position bias vectors|| / ||exact gradient||, both over all positions
  grad cosine       cosine of the expected gradient with the exact one (all positions as one vector)
  grad norm ratio   ||expected gradient|| / ||exact gradient||
  grad variance     sum_i Var g_i / sum_i ||grad KL_i||^2  (the variance of one sample per position)
  memory, time      log-probs kept per token (k + 1; a union's 2k + 1), and microseconds per token of the
                    estimator as training runs it (the lean form, forward and backward)

Every head (the sampler's top-k, the anchor's, their union) and tail (docs/METHOD.md section 3.5) of the
top-k estimators, at k = 1, 4, 32, 128.

plus the tail mass pi (or the anchor) leaves outside its top-k, and one figure against k.

The checkpoints come from the demo run with its step-10 checkpoint kept:

    emapg train --out runs/demo keep_checkpoints=3
    python bench/estimator_lab.py --run runs/demo
    # or, with a demo run that kept only its last two checkpoints, a 10-step run of the same seed:
    emapg train --out runs/demo10 steps=10 eval.size=0 save_every=10 export=false
    python bench/estimator_lab.py --run runs/demo --early-run runs/demo10
    # the distillation pair only (the demo's anchor as the teacher of the initial SmolLM2):
    python bench/estimator_lab.py --teacher runs/demo/export/anchor --out runs/estimator_lab_opd
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch

ROOT = Path(__file__).resolve().parents[1]
GSM8K = "emapg:gsm8k_test"  # the GSM8K test set shipped with the package (row for row GSM8K's test split)
KS = (1, 4, 32, 128)
SAMPLED = ("k1", "k2", "k3", "k3pp", "k4", "k5")


def configs() -> list[tuple[str, str | None, str, int]]:
    """(estimator, head, form, k): the sampled estimators, and every head and tail of the top-k ones."""
    from emapg import kl

    out = [(name, None, "unbiased", 0) for name in SAMPLED]
    out += [(name, head, form, k) for name in ("topk_reverse", "topk_forward") for head in kl.HEAD_CHOICES
            for form in kl.FORMS for k in KS]
    return out


def key(name: str, head: str | None, form: str, k: int) -> str:
    return f"{name}|{head or '-'}|{form}|{k}"


def load_pair(run: Path, step: int, which: str):
    """(policy, anchor) models: the step's policy against the initial model (``early``) or its anchor."""
    from safetensors.torch import load_file

    from emapg.models.zoo import load_model

    policy, tok = load_model("smollm2-135m", "float32")
    anchor, _ = load_model("smollm2-135m", "float32")
    ckpt = run / "checkpoints" / f"step_{step:06d}"
    policy.load_state_dict(load_file(ckpt / "policy.safetensors"), strict=False)
    if which == "trained":
        avg = {k[len("average."):]: v for k, v in load_file(ckpt / "anchor.safetensors").items()
               if k.startswith("average.")}
        anchor.load_state_dict(avg, strict=False)
    for m in (policy, anchor):
        m.eval().requires_grad_(False)
    return policy, anchor, tok


def load_distill_pair(teacher: str):
    """(student, teacher): the initial SmolLM2-135M-Instruct and a teacher with its tokenizer."""
    from emapg.models.zoo import load_model, vocab_difference

    student, tok = load_model("smollm2-135m", "float32")
    teach, teacher_tok = load_model(teacher, "float32")
    diff = vocab_difference(tok, teacher_tok)
    if diff or teach.get_output_embeddings().weight.shape != student.get_output_embeddings().weight.shape:
        raise SystemExit(f"--teacher {teacher}: not SmolLM2's tokenizer and vocabulary ({diff or 'output size'})")
    for m in (student, teach):
        m.eval().requires_grad_(False)
    return student, teach, tok


def positions(policy, anchor, tok, examples, max_new: int, seed: int, cap: int):
    """Policy and anchor logits [N, V] (float64) at up to ``cap`` positions of sampled responses."""
    from emapg.models.lm import positions as position_ids
    from emapg.rollout.hf import generate
    from emapg.rollout.sampling import SamplingSpec

    torch.manual_seed(seed)
    batch = generate(policy, tok, examples, SamplingSpec(n=1, temperature=1.0, max_new_tokens=max_new))
    ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)
    att = torch.cat([batch.prompt_mask, torch.ones_like(batch.response_ids)], 1)
    lp = batch.prompt_ids.shape[1]
    c = batch.response_ids.shape[1]
    valid = batch.response_mask.bool()
    out = []
    with torch.no_grad():
        for model in (policy, anchor):
            logits = model(input_ids=ids, attention_mask=att, position_ids=position_ids(att)).logits
            out.append(logits[:, lp - 1 : lp - 1 + c][valid].double()[:cap])
    return out


def lab(policy_logits: torch.Tensor, anchor_logits: torch.Tensor) -> dict:
    from emapg import kl
    from emapg.kl_moments import exact_kl, moments

    n = policy_logits.shape[0]
    exact = {d: [exact_kl(policy_logits[i], anchor_logits[i], d) for i in range(n)] for d in ("reverse", "forward")}
    rows = {}
    for name, head, form, k in configs():
        direction = kl.ESTIMATORS[name].direction
        bias_v, bias_g2, dot, var_g, kl_sum, g2, gm2 = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
        for i in range(n):
            value, grad = exact[direction][i]
            m = moments(name, policy_logits[i], anchor_logits[i], k=k, form=form, head=head)
            bias_v += m.value - value
            bias_g2 += float((m.grad - grad).pow(2).sum())
            dot += float(m.grad @ grad)
            gm2 += float(m.grad.pow(2).sum())
            var_g += m.grad_var
            kl_sum += value
            g2 += float(grad.pow(2).sum())
        ids = 0 if not kl.ESTIMATORS[name].topk else (2 * k if head == "union" else k)
        rows[key(name, head, form, k)] = {
            "estimator": name, "head": head, "form": form, "k": k, "direction": direction,
            "value_bias": bias_v / kl_sum, "grad_bias": (bias_g2 / g2) ** 0.5,
            "grad_cosine": dot / max((gm2 * g2) ** 0.5, 1e-300), "grad_norm_ratio": (gm2 / g2) ** 0.5,
            "grad_var": var_g / g2, "gathered_per_token": ids + 1,
            "us_per_token": lean_time(name, head, form, k, policy_logits, anchor_logits)}
    pi = torch.softmax(policy_logits, -1)
    anc = torch.softmax(anchor_logits, -1)
    tails = {}
    for k in KS:
        for who, p in (("policy", pi), ("anchor", anc)):
            t = (1 - p.topk(k, -1).values.sum(-1)).tolist()
            q = statistics.quantiles(t, n=10)
            tails[f"{who}|{k}"] = {"median": statistics.median(t), "p90": q[-1], "max": max(t)}
    kl_rev = [v for v, _ in exact["reverse"]]
    return {"positions": n, "kl_reverse_mean": sum(kl_rev) / n, "estimators": rows, "tails": tails}


def _own(name: str) -> str:
    """The head a top-k estimator takes by default (the figure's curves)."""
    from emapg import kl

    return kl.ESTIMATORS[name].default_head


def lean_time(name: str, head: str | None, form: str, k: int, policy_logits: torch.Tensor,
              anchor_logits: torch.Tensor, reps: int = 5) -> float:
    """Microseconds per token of the estimator as training runs it (the lean form on gathered log-probs,
    forward and backward), median of ``reps``; the gathers themselves are the chunked head pass's."""
    from emapg import kl

    est = kl.ESTIMATORS[name]
    lp, la = torch.log_softmax(policy_logits.float(), -1), torch.log_softmax(anchor_logits.float(), -1)
    tokens = torch.multinomial(lp.exp(), 1, generator=torch.Generator().manual_seed(0))
    ids, mask = kl.choose_head(head, k, lp, la) if est.topk else (None, None)
    times = []
    for _ in range(reps):
        pol_tok = lp.gather(-1, tokens)[:, 0].clone().requires_grad_(True)
        pol_q = None if ids is None else lp.gather(-1, ids).clone().requires_grad_(True)
        start = time.perf_counter()
        f = kl.kl_from_logprobs(name, pol_tok, la.gather(-1, tokens)[:, 0], policy_logp_q=pol_q,
                                anchor_logp_q=None if ids is None else la.gather(-1, ids),
                                in_q=None if ids is None else kl.in_head(ids, tokens[:, 0]), head_mask=mask, form=form)
        f.sum().backward()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times) / lp.shape[0]


def figure(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 2, figsize=(10, 3.4 * len(results)), squeeze=False)
    for row, (pair, res) in enumerate(results.items()):
        est = res["estimators"]
        for col, (metric, label) in enumerate((("grad_var", "gradient variance / ||grad KL||^2"),
                                               ("grad_bias", "gradient bias / ||grad KL||"))):
            ax = axes[row][col]
            for name in ("topk_reverse", "topk_forward"):
                for form, style in (("unbiased", "-"), ("paper", "--"), ("bucket", "-."), ("residual", ":")):
                    ys = [max(est[key(name, _own(name), form, k)][metric], 1e-12) for k in KS]
                    ax.plot(KS, ys, style, marker="o", ms=3, label=f"{name} {form}")
            for name in ("k3", "k3pp", "k4"):
                ax.axhline(max(est[key(name, None, "unbiased", 0)][metric], 1e-12), lw=0.8, ls=":", label=name,
                           color={"k3": "gray", "k3pp": "brown", "k4": "black"}[name])
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("k")
            ax.set_title(f"{pair}: {label}", fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(results: dict) -> str:
    lines = []
    for pair, res in results.items():
        lines += [f"### {pair}: {res['positions']} positions, mean reverse KL {res['kl_reverse_mean']:.4f}", "",
                  "| estimator | head | form | k | value bias | grad bias | grad cosine | grad norm ratio | "
                  "grad variance | log-probs kept per token | us per token |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in res["estimators"].values():
            lines.append(f"| {r['estimator']} | {r['head'] or '-'} | {r['form']} | {r['k'] or '-'} | "
                         f"{r['value_bias']:+.3f} | {r['grad_bias']:.3f} | {r['grad_cosine']:.4f} | "
                         f"{r['grad_norm_ratio']:.3f} | {r['grad_var']:.3g} | {r['gathered_per_token']} | "
                         f"{r['us_per_token']:.2f} |")
        lines += ["", "| k | policy tail mass: median / p90 / max | anchor tail mass: median / p90 / max |",
                  "|---|---|---|"]
        for k in KS:
            p, a = res["tails"][f"policy|{k}"], res["tails"][f"anchor|{k}"]
            lines.append(f"| {k} | {p['median']:.3g} / {p['p90']:.3g} / {p['max']:.3g} | "
                         f"{a['median']:.3g} / {a['p90']:.3g} / {a['max']:.3g} |")
        lines.append("")
    return "\n".join(lines)


def _ratio_range(ratios: list[float]) -> dict:
    return {"min": min(ratios), "max": max(ratios), "rows": len(ratios)}


def summary(results: dict) -> dict:
    """What the docs say of a family run, computed from its rows (so each quoted range links to a value):
    the residual tail's gradient variance against the unbiased tail's (how many times less: the unbiased's
    over the residual's) with the sampler's head, over every k and pair, reverse and forward; the forward
    rows, every head, where the residual has more variance than the paper's form; the K+1 bucket's gradient
    bias at k = 32 with the sampler's head (reverse); the unbiased top-k reverse KL's variance at k = 32
    against k3++'s, per pair."""
    def var(pair: str, name: str, head: str | None, form: str, k: int) -> float:
        return results[pair]["estimators"][key(name, head, form, k)]["grad_var"]

    pairs = list(results)
    heads = sorted({r["head"] for r in results[pairs[0]]["estimators"].values() if r["head"]})
    forward = [var(p, "topk_forward", h, "residual", k) / var(p, "topk_forward", h, "paper", k)
               for p in pairs for h in heads for k in KS]
    return {
        "reverse_sampler_unbiased_over_residual_var": _ratio_range(
            [var(p, "topk_reverse", "sampler", "unbiased", k) / var(p, "topk_reverse", "sampler", "residual", k)
             for p in pairs for k in KS]),
        "reverse_sampler_residual_below_paper_var": sum(
            var(p, "topk_reverse", "sampler", "residual", k) < var(p, "topk_reverse", "sampler", "paper", k)
            for p in pairs for k in KS),
        "forward_sampler_unbiased_over_residual_var": _ratio_range(
            [var(p, "topk_forward", "sampler", "unbiased", k) / var(p, "topk_forward", "sampler", "residual", k)
             for p in pairs for k in KS]),
        "forward_residual_over_paper_var": {**_ratio_range(forward), "above_1": sum(r > 1 for r in forward)},
        "reverse_sampler_bucket_grad_bias_k32": _ratio_range(
            [results[p]["estimators"][key("topk_reverse", "sampler", "bucket", 32)]["grad_bias"] for p in pairs]),
        "reverse_sampler_unbiased_over_k3pp_var_k32": {
            p: var(p, "topk_reverse", "sampler", "unbiased", 32) / var(p, "k3pp", None, "unbiased", 0) for p in pairs},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, default=None, help="a demo run folder with checkpoints at steps 10 and 30")
    p.add_argument("--teacher", default=None,
                   help="a teacher model folder: adds the distillation pair (the initial SmolLM2 as the student)")
    p.add_argument("--early-run", type=Path, default=None,
                   help="the run folder holding the step-10 checkpoint, if not --run (a 10-step run of the same "
                        "seed has the same step 10: every step seeds itself)")
    p.add_argument("--positions", type=int, default=200, help="positions per dataset and pair")
    p.add_argument("--out", type=Path, default=Path("runs/estimator_lab"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--summarize", type=Path, default=None,
                   help="a family run's results.json: write its summary (the ranges the docs quote) beside it as "
                        "NAME_summary.json, and run nothing")
    args = p.parse_args()
    if args.summarize is not None:
        out = args.summarize.with_name(args.summarize.stem + "_summary.json")
        out.write_text(json.dumps(summary(json.loads(args.summarize.read_text())), indent=1) + "\n")
        print(out.read_text())
        return
    if args.run is None and args.teacher is None:
        p.error("give --run (the early and trained pairs), --teacher (the distillation pair), or both")
    for run, step in ((args.early_run or args.run, 10), (args.run, 30)):
        if run is not None and not (run / "checkpoints" / f"step_{step:06d}").is_dir():
            p.error(f"{run} has no step-{step} checkpoint: make it with `emapg train --out runs/demo "
                    "keep_checkpoints=3` (or a 10-step run for --early-run, as this script's help shows)")
    from emapg.models.zoo import BUILTIN

    if args.teacher is not None and args.teacher not in BUILTIN and not (Path(args.teacher) / "config.json").is_file():
        p.error(f"--teacher {args.teacher}: not a model folder (the demo's is made by emapg train --out runs/demo)")
    torch.set_num_threads(args.threads)
    from emapg.tasks import make_task

    data = {"arithmetic": (make_task("arithmetic", digits=2, ops="+", terms=2).eval_examples(24), 32),
            "gsm8k": (make_task("math", eval_file=GSM8K, template="chat").eval_examples(12), 64)}
    random.seed(0)
    results = {}
    pairs = ([("early", 10), ("trained", 30)] if args.run else []) + ([("distill", 0)] if args.teacher else [])
    for pair, step in pairs:
        if pair == "distill":
            policy, anchor, tok = load_distill_pair(args.teacher)
        else:
            policy, anchor, tok = load_pair(args.early_run or args.run if pair == "early" else args.run, step, pair)
        logits = [positions(policy, anchor, tok, ex, max_new, seed=0, cap=args.positions)
                  for ex, max_new in data.values()]
        pol = torch.cat([x[0] for x in logits])
        anc = torch.cat([x[1] for x in logits])
        results[pair] = lab(pol, anc)
        print(f"{pair}: {pol.shape[0]} positions", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    if len(results) == 3:  # every pair: the family's summary, the ranges the docs quote
        (args.out / "results_summary.json").write_text(json.dumps(summary(results), indent=1) + "\n")
    figure(results, args.out / "estimator_lab.png")
    (args.out / "results.md").write_text(markdown(results) + "\n")
    print(markdown(results))


if __name__ == "__main__":
    main()
