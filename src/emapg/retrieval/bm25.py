"""An embedded BM25 index (bm25s + PyStemmer, English stemming and stopwords).

``build_index(corpus, out)`` turns a JSONL/JSON/Parquet corpus of ``{id, title?, text}`` rows into an
index folder; ``BM25Index.load(out).search(queries, topk)`` answers queries. The folder holds bm25s's
sparse score matrix (``.npy`` + JSON files, no pickle), ``passages.jsonl`` (the passages in index order)
and ``emapg_index.json`` (metadata). Building writes a temporary sibling folder and renames it into place,
so an existing index is replaced only once the new one is complete.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np

from emapg.atomic import folder_atomic
from emapg.data import DataError
from emapg.errors import MissingPackage
from emapg.retrieval import Passage
from emapg.retrieval.passages import (
    DENSE_DIR,
    PASSAGES_FILE,
    Passages,
    has_dense,
    passages_digest,
    read_corpus,
    read_meta,
    read_passages,
    write_passages,
)

FORMAT_VERSION = 1
META_FILE = "emapg_index.json"
STEMMER_LANGUAGE = "english"
STOPWORDS = "en"
_BM25S_FILES = ("params.index.json", "vocab.index.json", "data.csc.index.npy", "indices.csc.index.npy",
                "indptr.csc.index.npy")


def _import_bm25s():
    try:
        import bm25s  # (optional: emapg[search])
        import Stemmer  # (optional: emapg[search])
    except ImportError as e:
        raise MissingPackage(f"the BM25 retriever needs bm25s and PyStemmer ({e}); "
                          "install them with: pip install 'emapg[search]'") from None
    return bm25s, Stemmer


def _replaceable(out: Path) -> bool:
    """Whether ``out`` may be replaced: absent, an empty folder, an existing index or a dense-only one
    (``emapg index import-dense --corpus``: its passages and dense index, no BM25 yet)."""
    if not out.exists():
        return True
    dense_only = has_dense(out) and (out / PASSAGES_FILE).is_file()
    return out.is_dir() and ((out / META_FILE).is_file() or dense_only or not any(out.iterdir()))


def _keep_dense(out: Path, tmp: Path) -> str | None:
    """Carry an existing dense index into a rebuilt folder when the passages are byte-identical
    (``"kept"``); a dense index of other passages is dropped (``"dropped"``: ``DenseIndex.load`` would
    refuse it anyway); None when there was none."""
    if not has_dense(out):
        return None
    if (out / PASSAGES_FILE).is_file() and passages_digest(out) == passages_digest(tmp):
        shutil.copytree(out / DENSE_DIR, tmp / DENSE_DIR, copy_function=os.link)  # hard links: no second copy
        return "kept"
    return "dropped"


def build_index(corpus: str | Path, out: str | Path, fields: dict[str, str] | None = None) -> dict:
    """Index a corpus of ``{id, title?, text}`` rows into the folder ``out``; returns the index metadata.

    ``fields`` renames columns as in ``emapg.data.load_rows`` (``{"text": "contents"}``). Raises DataError
    for a malformed corpus (naming file, line and field, or a duplicate id) and FileExistsError if ``out``
    exists and is neither an index nor an empty folder. The returned metadata's ``dense`` says what became
    of a dense index the folder held: ``"kept"`` (the same passages), ``"dropped"`` (other passages: it is
    encoded again with ``emapg index dense``) or None (there was none).
    """
    bm25s, Stemmer = _import_bm25s()
    start = time.perf_counter()
    corpus, out = Path(corpus), Path(out)
    if not _replaceable(out):
        raise FileExistsError(f"{out} exists and is not an emapg index or an empty folder; refusing to replace it")
    passages = read_corpus(corpus, fields)
    titles, texts = passages.titles, passages.texts
    tokens = bm25s.tokenize([f"{t} {x}" if t else x for t, x in zip(titles, texts, strict=True)],
                            stopwords=STOPWORDS, stemmer=Stemmer.Stemmer(STEMMER_LANGUAGE), show_progress=False)
    retriever = bm25s.BM25()
    retriever.index(tokens, show_progress=False)
    del tokens

    with folder_atomic(out) as tmp:  # a rebuilt index replaces the old one only when complete
        retriever.save(tmp, show_progress=False)
        write_passages(passages, tmp)
        dense = _keep_dense(out, tmp)
        meta = {
            "format_version": FORMAT_VERSION,
            "documents": len(passages),
            "corpus": str(corpus.resolve()),
            "stemmer": STEMMER_LANGUAGE,
            "stopwords": STOPWORDS,
            "bm25s_version": bm25s.__version__,
            "build_seconds": round(time.perf_counter() - start, 3),
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return {**meta, "dense": dense}


class BM25Index:
    """A loaded BM25 index; ``search`` is safe to call from many threads at once."""

    def __init__(self, path: Path, retriever, passages: Passages, meta: dict):
        self.path = path
        self.meta = meta
        self._bm25 = retriever
        self._vocab = retriever.vocab_dict
        self._passages = passages
        self._ids, self._titles, self._texts = passages.ids, passages.titles, passages.texts
        self._local = threading.local()  # PyStemmer objects are not thread-safe: one per thread

    @classmethod
    def load(cls, path: str | Path, mmap: bool = False) -> BM25Index:
        """Load an index folder written by ``build_index`` (``mmap`` maps the score matrix instead of reading it)."""
        bm25s, _ = _import_bm25s()
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"BM25 index folder {path} does not exist")
        missing = [name for name in (META_FILE, PASSAGES_FILE, *_BM25S_FILES) if not (path / name).is_file()]
        if missing:
            raise FileNotFoundError(f"{path} is not an emapg BM25 index: missing {', '.join(missing)} "
                                    "(build one with emapg.retrieval.bm25.build_index)")
        meta = read_meta(path / META_FILE)
        if meta.get("format_version") != FORMAT_VERSION:
            raise DataError(f"{path}: unsupported index format version {meta.get('format_version')!r} "
                             f"(this emapg reads version {FORMAT_VERSION}); rebuild the index")
        passages = read_passages(path)
        retriever = bm25s.BM25.load(path, mmap=mmap, load_corpus=False, show_progress=False)
        n = int(retriever.scores["num_docs"])
        if n != len(passages):
            raise DataError(f"{path}: the BM25 matrix has {n} documents but {PASSAGES_FILE} has {len(passages)}; "
                             "rebuild the index")
        return cls(path, retriever, passages, meta)

    @property
    def passages(self) -> Passages:
        """The index's passages in index order, with the digest of the file they were read from (not a copy)."""
        return self._passages

    def __len__(self) -> int:
        return len(self._ids)

    def __repr__(self) -> str:
        return f"BM25Index({str(self.path)!r}, documents={len(self)})"

    def _tokens(self, query: str) -> list[str]:
        """The query's stemmed tokens that occur in the index (stopwords and unknown words dropped)."""
        bm25s, Stemmer = _import_bm25s()
        stemmer = getattr(self._local, "stemmer", None)
        if stemmer is None:
            stemmer = self._local.stemmer = Stemmer.Stemmer(STEMMER_LANGUAGE)
        (tokens,) = bm25s.tokenize([query], stopwords=STOPWORDS, stemmer=stemmer, return_ids=False,
                                   show_progress=False)
        return [t for t in tokens if t and t in self._vocab]

    def search(self, queries: list[str], topk: int = 3) -> list[list[Passage]]:
        """The ``topk`` best passages for each query, best first.

        Only passages sharing at least one term with the query are returned, so a query that is empty or
        made only of stopwords and unknown words gets an empty list.
        """
        if isinstance(queries, str):
            raise TypeError("search takes a list of queries, not a single string")
        if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1:
            raise ValueError(f"topk must be an integer >= 1, got {topk!r}")
        n = len(self._ids)
        results = []
        for q in queries:
            if not isinstance(q, str):
                raise TypeError(f"queries must be strings, got {type(q).__name__}")
            tokens = self._tokens(q)
            if not tokens:
                results.append([])
                continue
            # get_scores only reads the (immutable) score matrix and allocates its own output array,
            # so concurrent calls need no lock.
            scores = np.asarray(self._bm25.get_scores(tokens))
            k = min(topk, n)
            cand = np.argpartition(scores, n - k)[n - k:] if k < n else np.arange(n)
            cand = cand[np.lexsort((cand, -scores[cand]))]  # best first; ties by index order
            results.append([Passage(self._ids[i], self._titles[i], self._texts[i], float(scores[i]))
                            for i in cand.tolist() if scores[i] > 0])
        return results
