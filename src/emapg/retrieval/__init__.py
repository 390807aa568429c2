"""Passage retrieval for search-augmented tasks: an embedded BM25 index and a Search-R1 compatible HTTP API.

``open_retriever(index=...)`` loads a local index built by ``emapg.retrieval.bm25.build_index``;
``open_retriever(url=...)`` talks to a server speaking Search-R1's ``POST /retrieve`` protocol
(``emapg.retrieval.server`` or Search-R1's own retrieval server).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = ["Passage", "Retriever", "RetrieverError", "open_retriever",
           "BM25Index", "build_index", "HTTPRetriever", "make_server", "serve"]


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


def open_retriever(index: str | None = None, url: str | None = None) -> Retriever:
    """A retriever on a local BM25 index folder (``index``) or a retrieval server (``url``); give exactly one."""
    if (index is None) == (url is None):
        raise ValueError("open_retriever needs exactly one of index= (a BM25 index folder) "
                         "or url= (a retrieval server)")
    if index is not None:
        from emapg.retrieval.bm25 import BM25Index

        return BM25Index.load(index)
    from emapg.retrieval.client import HTTPRetriever

    return HTTPRetriever(url)


_LAZY = {"BM25Index": "bm25", "build_index": "bm25", "HTTPRetriever": "client", "make_server": "server",
         "serve": "server"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
