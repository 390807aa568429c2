"""Hybrid retrieval: BM25 and dense rankings fused by reciprocal rank (Cormack, Clarke and Buettcher 2009).

A passage's fused score is the sum, over the rankings it appears in, of 1 / (c + rank) (rank from 1,
c = 60 as in the paper); each ranking is cut at ``depth`` passages. Scores from the two retrievers are on
different scales, and ranks need no calibration between them.
"""

from __future__ import annotations

from emapg.errors import ConfigError
from emapg.retrieval import Passage, Retriever

RRF_C = 60


def rrf(rankings: list[list[Passage]], topk: int, c: int = RRF_C) -> list[Passage]:
    """The ``topk`` best passages of several rankings by reciprocal-rank fusion, best first (ties: the
    passage met first, rankings in the given order); each returned passage's score is its fused score."""
    score: dict[str, float] = {}
    first: dict[str, Passage] = {}
    for ranking in rankings:
        for rank, p in enumerate(ranking, start=1):
            score[p.id] = score.get(p.id, 0.0) + 1.0 / (c + rank)
            first.setdefault(p.id, p)
    order = sorted(first, key=lambda pid: -score[pid])  # sorted is stable: ties keep first-met order
    return [Passage(pid, first[pid].title, first[pid].text, score[pid]) for pid in order[:topk]]


class HybridRetriever:
    """Reciprocal-rank fusion of a sparse and a dense retriever over the same passages."""

    def __init__(self, sparse: Retriever, dense: Retriever, depth: int = 50, c: int = RRF_C):
        if depth < 1 or c < 0:
            raise ConfigError(f"hybrid retrieval: depth must be >= 1 and c >= 0, got {depth}, {c}")
        self.sparse, self.dense, self.depth, self.c = sparse, dense, depth, c
        self.devices = getattr(dense, "devices", None)

    def __len__(self) -> int:
        return len(self.sparse)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"HybridRetriever({self.sparse!r}, {self.dense!r}, depth={self.depth})"

    def search(self, queries: list[str], topk: int = 3) -> list[list[Passage]]:
        if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1:
            raise ValueError(f"topk must be an integer >= 1, got {topk!r}")
        depth = max(self.depth, topk)
        sparse, dense = self.sparse.search(queries, depth), self.dense.search(queries, depth)
        return [rrf([s, d], topk, self.c) for s, d in zip(sparse, dense, strict=True)]
