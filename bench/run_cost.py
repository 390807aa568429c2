"""What a run costs: wall time, peak memory and disk of one `emapg train` command (default: the demo).

    python bench/run_cost.py                       # the demo, as `bash scripts/demo.sh` runs it
    python bench/run_cost.py -- steps=10 keep_checkpoints=1 export=false   # any overrides of emapg train

The command runs as a child process; its peak resident memory is the kernel's record for it
(``ru_maxrss``), the run folder's size is sampled every second while it runs (the largest seen: a
checkpoint being written sits beside the ones kept until the newest is complete) and measured at the
end, file by kind (checkpoints, export, the rest). Prints a Markdown table row for the README.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def folder_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:  # renamed or pruned while walking
                pass
    return total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="run folder (default: a temporary one, removed afterwards)")
    p.add_argument("overrides", nargs="*", help="KEY=VALUE overrides of emapg train (after --)")
    args = p.parse_args()
    tmp = None
    if args.out:
        out = Path(args.out)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="emapg-run-cost-")
        out = Path(tmp.name) / "run"
    cmd = [sys.executable, "-m", "emapg", "train", "--out", str(out), *args.overrides]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    disk_peak = 0
    while proc.poll() is None:
        if out.exists():
            disk_peak = max(disk_peak, folder_bytes(out))
        time.sleep(1.0)
    wall = time.perf_counter() - start
    err = proc.stderr.read()
    if proc.returncode != 0:
        print(err[-3000:], file=sys.stderr)
        return proc.returncode
    peak_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB -> GiB
    final = folder_bytes(out)
    disk_peak = max(disk_peak, final)
    parts = {name: folder_bytes(out / name) for name in ("checkpoints", "export")}
    gb = 1e9
    print(f"command: emapg train {' '.join(args.overrides)}")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    print(f"wall time: {wall / 60:.1f} min")
    print(f"peak memory (resident): {peak_rss:.2f} GiB")
    print(f"disk at the end: {final / gb:.2f} GB (checkpoints {parts['checkpoints'] / gb:.2f}, "
          f"export {parts['export'] / gb:.2f}, the rest {(final - sum(parts.values())) / gb:.3f}); "
          f"largest while running: {disk_peak / gb:.2f} GB")
    print(f"| {' '.join(args.overrides) or '(the demo)'} | {wall / 60:.1f} min | {peak_rss:.2f} GiB | "
          f"{final / gb:.2f} GB ({disk_peak / gb:.2f} GB at most) |")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
