"""Passage retrieval for search-augmented tasks: BM25, dense and hybrid retrievers over one index folder,
and a Search-R1 compatible HTTP API.

``open_retriever(index=..., kind=...)`` loads a local index folder: ``bm25`` (built by
``emapg.retrieval.bm25.build_index``), ``dense`` (its ``dense/`` part, ``emapg.retrieval.dense.build_dense``)
or ``hybrid`` (both, fused by reciprocal rank); ``open_retriever(url=...)`` talks to a server speaking
Search-R1's ``POST /retrieve`` protocol (``emapg.retrieval.server`` or Search-R1's own retrieval server).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = ["Passage", "Retriever", "RetrieverError", "open_retriever", "KINDS",
           "BM25Index", "build_index", "DenseIndex", "build_dense", "HybridRetriever", "HTTPRetriever",
           "make_server", "serve"]

KINDS = ("bm25", "dense", "hybrid")
"""The retrievers an index folder can serve."""

SERVER_LIMITS = {"max_queries": 4096, "max_query_chars": 2048, "max_topk": 50, "max_body_bytes": 16 << 20}
"""What one request to ``emapg serve-retriever`` may carry, by default (each a flag of the command): the
paper's search step sends 512 prompts x 5 episodes = 2,560 queries a turn."""


@dataclass(frozen=True)
class Passage:
    """One retrieved passage; ``score`` is the retriever's relevance score (higher is better)."""

    id: str
    title: str
    text: str
    score: float = 0.0

    @property
    def contents(self) -> str:
        """The passage in Search-R1's ``contents`` format: ``"Title"`` on the first line, then the text."""
        return f'"{self.title}"\n{self.text}' if self.title else self.text


class RetrieverError(RuntimeError):
    """A retrieval request failed (unreachable server, rejected request, malformed answer)."""


@runtime_checkable
class Retriever(Protocol):
    """Anything that answers a batch of queries with the ``topk`` best passages for each, best first."""

    def search(self, queries: list[str], topk: int = 3) -> list[list[Passage]]: ...


def open_retriever(index: str | None = None, url: str | None = None, kind: str = "bm25",
                   search_params: dict | None = None) -> Retriever:
    """A retriever on a local index folder (``index``, as ``kind``: bm25, dense or hybrid) or a retrieval
    server (``url``, which chose its own kind); give exactly one of index and url. ``search_params``: the
    dense index's faiss search parameters (``{"nprobe": 64}``) over the ones it was built with."""
    if (index is None) == (url is None):
        raise ValueError("open_retriever needs exactly one of index= (an index folder) "
                         "or url= (a retrieval server)")
    if kind not in KINDS:
        raise ValueError(f"retriever: expected one of {', '.join(KINDS)}, got {kind!r}")
    if search_params and (index is None or kind == "bm25"):
        raise ValueError("search_params: faiss search parameters apply to a local dense or hybrid retriever, "
                         f"not to {'a retrieval server' if index is None else 'bm25'}")
    if index is None:
        from emapg.retrieval.client import HTTPRetriever

        return HTTPRetriever(url)
    from emapg.retrieval.bm25 import BM25Index

    if kind == "bm25":
        return BM25Index.load(index)
    from emapg.retrieval.dense import DenseIndex  # only for the kinds that need it

    if kind == "dense":
        return DenseIndex.load(index, search_params=search_params)
    from emapg.retrieval.hybrid import HybridRetriever

    sparse = BM25Index.load(index)
    # one copy of the text, read and hashed once
    return HybridRetriever(sparse, DenseIndex.load(index, passages=sparse.passages, search_params=search_params))


_LAZY = {"BM25Index": "bm25", "build_index": "bm25", "DenseIndex": "dense", "build_dense": "dense",
         "HybridRetriever": "hybrid", "HTTPRetriever": "client", "make_server": "server", "serve": "server"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
