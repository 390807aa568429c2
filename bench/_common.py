"""Helpers the benchmarks share: peak resident memory of a block of code; where and at which commit a
measurement ran (every published record names both)."""

from __future__ import annotations

import os
import platform
import subprocess
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rss_mb() -> float:
    """This process's resident set size, in MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class PeakRSS:
    """Highest resident set size seen while the context is open, sampled by a thread every 2 ms;
    ``peak - base`` is what the block added above the level when it began."""

    def __enter__(self):
        self.base = self.peak = rss_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_mb())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_mb())

    @property
    def extra(self) -> float:
        return self.peak - self.base


def machine() -> dict:
    """Where a measurement ran: the CPU's model name and the flags that choose its kernels, its cores, the OS, torch's
    version."""
    import torch

    from emapg.models.distributed import KERNEL_FLAGS, cpu_flags, cpu_model

    flags = cpu_flags()
    return {"cpu": cpu_model() or platform.processor() or platform.machine(),
            "cpu_flags": [f for f in KERNEL_FLAGS if f in flags], "cores": os.cpu_count(),
            "os": platform.platform(terse=True), "torch": torch.__version__}


def commit() -> str | None:
    """The commit of the emapg code this process runs (the tree its imported package is in: another checkout's
    under PYTHONPATH, for a before/after measurement), "+changes" when its src/ differs from it."""
    import emapg

    tree = Path(emapg.__file__).resolve().parents[2]
    tree = tree if (tree / "src" / "emapg").is_dir() else ROOT
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "src"], cwd=tree, capture_output=True, text=True)
    except OSError:
        return None
    return (out.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")) or None


def worker_env() -> dict[str, str]:
    """The environment of a measurement's own process: one thread, offline, the clone's src and bench importable."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "bench")])}
