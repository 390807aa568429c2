"""Keep a long comparison's finished runs in the repository, and put them back.

A study of many runs (studies/stability: 45 runs, several hours) spans sessions, and a later
session may start on a fresh machine. `emapg compare` skips a run whose eval.json exists and builds
its tables from each run's metrics.jsonl, eval.json and compute.json (and its per-problem outcomes,
outcomes/), so those few kilobytes per finished run (plus its config.yaml, for the record) are all a
study needs to continue and report:

    python bench/study_records.py save runs/stability studies/stability/records     # after some runs finished
    python bench/study_records.py restore studies/stability/records runs/stability  # on the next machine
    emapg compare --spec studies/stability/spec.yaml --out runs/stability --jobs 2   # runs only what is missing

Unfinished runs (no eval.json) are not saved: an interrupted run resumes from its checkpoint on the
same machine, or starts again on another.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

FILES = ("metrics.jsonl", "eval.json", "compute.json", "config.yaml", "outcomes/outcomes.jsonl",
         "outcomes/heldout.ids.json", "outcomes/transfer.ids.json",
         "outcomes/validation.ids.json")


def finished_runs(root: Path) -> list[Path]:
    """Run folders (CONFIG/seedK) under ``root`` whose eval.json exists, relative to ``root``."""
    return sorted(p.parent.relative_to(root) for p in root.glob("*/seed*/eval.json"))


def copy_runs(src: Path, dst: Path) -> list[Path]:
    """Copy each finished run's record files from ``src`` to ``dst``; never overwrite a run that is
    already complete at ``dst`` with a different one (say so instead). A run kept before all its files
    were written (compare adds compute.json after the trainer's eval.json) gets the missing ones."""
    copied = []
    for rel in finished_runs(src):
        target = dst / rel
        names = [name for name in FILES if (src / rel / name).exists()]
        if (target / "eval.json").exists():
            if (target / "eval.json").read_bytes() != (src / rel / "eval.json").read_bytes():
                sys.exit(f"study_records: {target} already holds a different finished run; not overwritten")
            names = [name for name in names if not (target / name).exists()]
            if not names:
                continue
        target.mkdir(parents=True, exist_ok=True)
        for name in names:
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / rel / name, target / name)
        copied.append(rel)
    return copied


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["save", "restore"])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    args = ap.parse_args(argv)
    if not args.src.is_dir():
        sys.exit(f"study_records: {args.src} is not a folder")
    copied = copy_runs(args.src, args.dst)
    print(f"study_records: {args.action}d {len(copied)} finished run(s) to {args.dst}: "
          + (", ".join(map(str, copied)) or "none new"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
