"""How many of emapg's source files one training step runs through, from the rollout to the first
``optimizer.step()`` (docs/ARCHITECTURE.md, "One training step"): the step of the ``smoke`` recipe traced with
Python's profiler, every emapg function it calls grouped by file. What a reader opens to follow the step.

    python bench/step_files.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from emapg.commands import recipe_path
from emapg.config import load_config
from emapg.run.trainer import Trainer

SRC = Path(__file__).resolve().parents[1] / "src" / "emapg"


def step_files(overrides: list[str]) -> dict[str, list[str]]:
    """{file under src/emapg: the functions of it the step calls} for the smoke recipe's first step."""
    cfg = load_config(recipe_path("smoke"), ["steps=1", *overrides])
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(cfg, out, progress=False)
        optimizer = trainer.run.optimizer
        seen: dict[str, set[str]] = {}
        done = False

        def profile(frame, event, arg):
            nonlocal done
            if done or event != "call":
                return
            code = frame.f_code
            if code.co_name == "step" and frame.f_locals.get("self") is optimizer:
                done = True  # the first optimizer step: the path ends here
                return
            path = Path(code.co_filename)
            if path.is_relative_to(SRC):
                seen.setdefault(str(path.relative_to(SRC)), set()).add(code.co_name)

        sys.setprofile(profile)
        try:
            trainer.train_step(1)
        finally:
            sys.setprofile(None)
    return {f: sorted(fns) for f, fns in sorted(seen.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="also write the files and their functions here")
    args = ap.parse_args()
    files = step_files([])
    for name, fns in files.items():
        print(f"{name:28s} {', '.join(f for f in fns if not f.startswith('<'))}")
    lines = sum(len((SRC / f).read_text().splitlines()) for f in files)
    print(f"{len(files)} files, {lines} lines: one step from the rollout to optimizer.step()")
    if args.json:
        args.json.write_text(json.dumps({"files": files, "lines": lines}, indent=1) + "\n")


if __name__ == "__main__":
    main()
