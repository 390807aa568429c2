"""Download the paper's 7 math evaluation sets as the reference prepares them, each to one JSONL file.

    python scripts/paper_evalsets.py --out /data/eval       # needs the network and, for LiveMathBench, a login

The sets, their sources and splits are the reference's (math/examples/deepscaler/prepare_all_math_data.py,
LunjunZhang/ema-pg): the same `datasets.load_dataset` calls, the rows written unchanged (the published columns,
not renamed), so `emapg eval --protocol paper` reads them as published. LiveMathBench is gated on the Hub: accept
its conditions on its page and log in (`hf auth login`) first. `--revision NAME=REV` pins a set to a commit.
The file names are the `--data` names docs/REPRODUCE.md's evaluation command uses.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# name: (Hub repository, configuration or None, split): the reference's calls, in its order
SETS = {
    "aime2024": ("HuggingFaceH4/aime_2024", None, "train"),
    "amc2023": ("opencompass/LiveMathBench", "v202412_AMC_en", "test"),
    "math500": ("HuggingFaceH4/MATH-500", None, "test"),
    "minerva": ("math-ai/minervamath", None, "test"),
    "olympiadbench": ("Hothan/OlympiadBench", "OE_TO_maths_en_COMP", "train"),
    "aime2025": ("MathArena/aime_2025", None, "train"),
    "amc2025": ("opencompass/LiveMathBench", "v202505_hard_en", "test"),
}
# the problems each set has as published (the reference's loader prints them; a different count means another
# revision of the set than the paper's)
EXPECTED_ROWS = {"aime2024": 30, "math500": 500, "minerva": 272, "aime2025": 30}


def fetch(out: Path, load, revisions: dict[str, str]) -> list[tuple[str, int, Path]]:
    """Each set through ``load`` (``datasets.load_dataset``'s signature), written as ``out/NAME.jsonl``."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (repo, config, split) in SETS.items():
        rows = load(repo, config, split=split, revision=revisions.get(name))
        path = out / f"{name}.jsonl"
        part = path.with_suffix(".jsonl.part")
        with part.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(dict(row), ensure_ascii=False) + "\n")
        part.replace(path)
        written.append((name, sum(1 for _ in path.open(encoding="utf-8")), path))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the folder the 7 JSONL files are written to")
    parser.add_argument("--revision", nargs="*", default=[], metavar="NAME=REV",
                        help=f"a set's Hub revision (commit); names: {', '.join(SETS)}")
    args = parser.parse_args(argv)
    revisions = dict(item.split("=", 1) for item in args.revision)
    unknown = sorted(set(revisions) - set(SETS))
    if unknown:
        parser.error(f"--revision: no set named {', '.join(unknown)} (the sets: {', '.join(SETS)})")
    from datasets import load_dataset

    for name, count, path in fetch(Path(args.out), load_dataset, revisions):
        expected = EXPECTED_ROWS.get(name)
        note = f" (the paper's has {expected})" if expected and expected != count else ""
        print(f"{name}: {count} problems -> {path}{note}")
    data = " ".join(f"{name}={Path(args.out) / name}.jsonl" for name in SETS)
    print(f"\nemapg eval --protocol paper --task math --data {data} --model ...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
