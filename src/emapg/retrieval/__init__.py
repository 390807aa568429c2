"""Passage retrieval for search-augmented tasks: BM25, dense and hybrid retrievers over one index folder,
and a Search-R1 compatible HTTP API.

``open_retriever(index=..., kind=...)`` loads a local index folder: ``bm25`` (built by
``emapg.retrieval.bm25.build_index``), ``dense`` (its ``dense/`` part, ``emapg.retrieval.dense.build_dense``)
or ``hybrid`` (both, fused by reciprocal rank); ``open_retriever(url=...)`` talks to a server speaking
Search-R1's ``POST /retrieve`` protocol (``emapg.retrieval.server`` or Search-R1's own retrieval server).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from emapg.errors import ConfigError, EmapgError

__all__ = ["Passage", "Retriever", "RetrieverError", "open_retriever", "RETRIEVERS", "register_retriever",
           "BM25Index", "build_index", "DenseIndex", "build_dense", "HybridRetriever", "HTTPRetriever",
           "make_server", "serve"]

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


class RetrieverError(EmapgError, RuntimeError):
    """A retrieval request failed (unreachable server, rejected request, malformed answer)."""


@runtime_checkable
class Retriever(Protocol):
    """Anything that answers a batch of queries with the ``topk`` best passages for each, best first."""

    def search(self, queries: list[str], topk: int = 3) -> list[list[Passage]]: ...


def _bm25(index: str, search_params: dict | None) -> Retriever:
    from emapg.retrieval.bm25 import BM25Index  # (cycle: bm25 imports Passage from this package)

    return BM25Index.load(index)


def _dense(index: str, search_params: dict | None, device: str = "cpu") -> Retriever:
    from emapg.retrieval.dense import DenseIndex  # only for the kinds that need it

    return DenseIndex.load(index, search_params=search_params, device=device)


def _hybrid(index: str, search_params: dict | None, device: str = "cpu") -> Retriever:
    from emapg.retrieval.bm25 import BM25Index  # (cycle: bm25 imports Passage from this package)
    from emapg.retrieval.dense import DenseIndex  # (cycle, and torch: only for the kinds that need it)
    from emapg.retrieval.hybrid import HybridRetriever  # (cycle: hybrid imports Passage from this package)

    sparse = BM25Index.load(index)
    # one copy of the text, read and hashed once
    return HybridRetriever(sparse, DenseIndex.load(index, passages=sparse.passages, search_params=search_params,
                                                   device=device))


RETRIEVERS: dict[str, Callable[[str, dict | None], Retriever]] = {"bm25": _bm25, "dense": _dense, "hybrid": _hybrid}
"""The retrievers an index folder can serve, by kind: ``open(index_folder, search_params) -> Retriever``. The
search task's ``task_args.retriever``, ``emapg serve-retriever --retriever`` and :func:`open_retriever` take
these; add one with :func:`register_retriever`."""

DENSE_KINDS = ("dense", "hybrid")
"""The kinds that read the dense index (and take faiss search parameters)."""


def register_retriever(kind: str, open_index: Callable[[str, dict | None], Retriever]) -> None:
    """Add a retriever kind (from a user's module): ``open_index(index_folder, search_params)`` returns anything
    with ``search(queries, topk) -> [[Passage, ...], ...]``. A kind already taken is refused."""
    if kind in RETRIEVERS:
        raise ValueError(f"retriever {kind!r} is already registered")
    RETRIEVERS[kind] = open_index


def retriever_problem(kind: str, index: str | None, url: str | None, search_params: Any,
                      device: str = "cpu") -> str | None:
    """What is wrong with asking for retriever ``kind`` on an index folder or a server (``url``), with faiss
    ``search_params`` and queries encoded on ``device``: a message naming the setting (``retriever: ...``,
    ``search_params: ...``, ``device: ...``), or None. Checked before anything loads, by :func:`open_retriever`,
    the search task and the server alike."""
    if kind not in RETRIEVERS:
        return f"retriever: expected one of {', '.join(RETRIEVERS)}, got {kind!r}"
    if url and kind != "bm25":
        return ("retriever: a retrieval server searches as it was started (emapg serve-retriever --retriever ...); "
                "leave the retriever kind out with a server")
    if search_params is not None and (not isinstance(search_params, dict) or url or kind not in DENSE_KINDS):
        return ("search_params: a mapping of faiss search parameters (e.g. {nprobe: 64}) for a local dense or "
                f"hybrid retriever, got {search_params!r} with {'a retrieval server' if url else kind}")
    if device != "cpu" and (url or kind not in DENSE_KINDS):
        return f"device: {device!r} is for a local dense or hybrid retriever (BM25 runs on the CPU)"
    if index and kind in DENSE_KINDS:
        from emapg.retrieval.passages import has_dense  # (cycle)

        if not has_dense(Path(index)):
            return f"retriever: {kind} needs a dense index in {index}; build it with: emapg index dense --index {index}"
    return None


def open_retriever(index: str | None = None, url: str | None = None, kind: str = "bm25",
                   search_params: dict | None = None, timeout: float = 30.0, device: str = "cpu") -> Retriever:
    """A retriever on a local index folder (``index``, as ``kind``: one of :data:`RETRIEVERS`) or a retrieval
    server (``url``, which chose its own kind); give exactly one of index and url. ``search_params``: the
    dense index's faiss search parameters (``{"nprobe": 64}``) over the ones it was built with. ``timeout``:
    seconds a request to a server may take (a turn of the paper's batch asks 2,560 queries at once). ``device``:
    where a dense or hybrid retriever encodes its queries (and holds its faiss index, with a GPU build of
    faiss); a kind a plugin registered gets it as a third argument when it is not the CPU."""
    if (index is None) == (url is None):
        raise ConfigError("open_retriever needs exactly one of index= (an index folder) "
                         "or url= (a retrieval server)")
    problem = retriever_problem(kind, index, url, search_params, device)
    if problem:
        raise ConfigError(problem)
    if index is None:
        from emapg.retrieval.client import HTTPRetriever  # (cycle: the client imports Passage from this package)

        return HTTPRetriever(url, timeout=timeout)
    if device == "cpu":
        return RETRIEVERS[kind](index, search_params)
    return RETRIEVERS[kind](index, search_params, device)


_LAZY = {"BM25Index": "bm25", "build_index": "bm25", "DenseIndex": "dense", "build_dense": "dense",
         "HybridRetriever": "hybrid", "HTTPRetriever": "client", "make_server": "server", "serve": "server"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib  # (cycle: the names below live in modules that import this package)

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
