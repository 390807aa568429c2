"""Helpers the benchmarks share: peak resident memory of a block of code."""

from __future__ import annotations

import os
import threading


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
