"""The ``emapg`` command line.

    emapg train [--config FILE] [--out DIR] [--resume DIR] [--nproc N] [KEY=VALUE ...]
    emapg eval  --model PATH_OR_NAME --task NAME [--data FILE ...] [--samples N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from emapg.config import ConfigError, load_config

DEFAULT_RECIPE = "cpu_demo.yaml"


def _recipe_path(name: str) -> Path:
    """A recipe shipped with the source tree (recipes/ beside src/)."""
    here = Path(__file__).resolve().parents[2] / "recipes" / name
    if here.exists():
        return here
    raise ConfigError(f"recipe {name} not found (looked in {here.parent}); pass --config FILE")


def _launch(args: argparse.Namespace, run_dir: Path) -> int:
    """Re-run this command under torchrun with ``args.nproc`` processes on this machine."""
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           "-m", "emapg", "train"]
    cmd += ["--resume", str(run_dir)] if args.resume else ["--out", str(run_dir)]
    if args.config:
        cmd += ["--config", args.config]
    return subprocess.call(cmd + list(args.overrides))


def cmd_train(args: argparse.Namespace) -> int:
    from emapg import distributed
    from emapg.trainer import Trainer

    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if launched and not (args.out or args.resume):
        raise ConfigError("--out: needed with more than one process (each would pick its own default folder)")
    if args.resume:
        run_dir = Path(args.resume)
        cfg_file = run_dir / "config.yaml"
        if not cfg_file.exists():
            raise ConfigError(f"--resume {run_dir}: {cfg_file} does not exist (is this a run folder?)")
        cfg = load_config(cfg_file, args.overrides)
    else:
        cfg = load_config(args.config or _recipe_path(DEFAULT_RECIPE), args.overrides)
        run_dir = Path(args.out or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{cfg.task}")
    if args.nproc > 1 and not launched:
        return _launch(args, run_dir)
    trainer = Trainer(cfg, run_dir, resume=bool(args.resume))
    if trainer.main:
        print(f"emapg: run folder {run_dir} ({trainer.dist.world} process(es), {trainer.dist.device})",
              file=sys.stderr)
    table = trainer.train()
    if trainer.main:
        from emapg.metrics import write_eval_table

        print(write_eval_table(run_dir, table))
    distributed.shutdown()
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    import torch

    from emapg.evaluate import evaluate
    from emapg.metrics import eval_markdown
    from emapg.models import load_model
    from emapg.tasks import make_task

    torch.manual_seed(args.seed)
    model, tok = load_model(args.model, args.dtype)
    task_args = json.loads(args.task_args) if args.task_args else {}
    greedy = args.samples <= 1 and args.temperature == 0
    temperature = args.temperature or 1.0
    datasets = [(Path(d).stem, {**task_args, "eval_file": d}) for d in args.data] if args.data else [
        (args.task, task_args)]
    rows = []
    for name, targs in datasets:
        task = make_task(args.task, **targs)
        examples = task.eval_examples(args.size)
        res = evaluate(model, tok, task, examples, max_new_tokens=args.max_new_tokens, greedy=greedy,
                       temperature=temperature, top_p=args.top_p, samples=args.samples, batch_size=args.batch_size)
        rows.append({"dataset": name, **res})
        print(f"emapg eval: {name}: {100 * res['accuracy']:.1f}% over {res['num']} samples", file=sys.stderr)
    md = eval_markdown(args.model, rows)
    print(md)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        settings = {"model": args.model, "task": args.task, "samples": args.samples, "greedy": greedy,
                    "temperature": None if greedy else temperature, "top_p": args.top_p,
                    "max_new_tokens": args.max_new_tokens}
        (out / "eval.json").write_text(json.dumps({**settings, "rows": rows}, indent=1))
        (out / "eval.md").write_text(md)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="emapg", description="EMA Policy Gradient for language models")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train with EMA-PG (default: recipes/cpu_demo.yaml)")
    t.add_argument("--config", help="YAML recipe")
    t.add_argument("--out", help="run folder (default runs/<time>-<task>)")
    t.add_argument("--resume", help="continue the run in this folder from its latest checkpoint")
    t.add_argument("--nproc", type=int, default=1,
                   help="data-parallel processes on this machine (runs torchrun; or launch torchrun yourself)")
    t.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. algo.eta=0.95 steps=100")
    t.set_defaults(func=cmd_train)
    e = sub.add_parser("eval", help="held-out accuracy of a model on a task")
    e.add_argument("--model", required=True, help="model folder or built-in name (smollm2-135m)")
    e.add_argument("--task", required=True)
    e.add_argument("--task-args", help='JSON, e.g. \'{"digits": 2}\' or \'{"template": "chat"}\'')
    e.add_argument("--data", nargs="+", help="eval files (math: JSONL/JSON/Parquet); one table row per file")
    e.add_argument("--samples", type=int, default=1, help="samples per problem (avg@n and pass@k when > 1)")
    e.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (only with --samples 1)")
    e.add_argument("--top-p", type=float, default=1.0)
    e.add_argument("--size", type=int, default=100_000, help="at most this many problems per dataset")
    e.add_argument("--batch-size", type=int, default=64)
    e.add_argument("--max-new-tokens", type=int, default=32)
    e.add_argument("--dtype", default="float32")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--out", help="folder for eval.json and eval.md")
    e.set_defaults(func=cmd_eval)
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"emapg: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
