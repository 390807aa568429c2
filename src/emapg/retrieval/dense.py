"""A dense retriever: passages encoded once by an embedder (``embed.py``) into a faiss index beside the BM25
index, in the same folder, over the same ``passages.jsonl``.

    INDEX/                  the BM25 index (``emapg index build``): passages.jsonl, emapg_index.json, ...
    INDEX/dense/            dense.json (the embedder, its prefixes, the passages' digest), index.faiss
    INDEX/.dense.partial/   while building: the encoded shards so far (a killed build resumes from them)

Vectors are unit-norm, so inner product is cosine similarity; the default faiss index is exact
(``Flat``); any faiss ``index_factory`` string (``HNSW32``, ``IVF4096,Flat``) may be given for large
corpora. An approximate index's search parameters (``nprobe`` for IVF, ``efSearch`` for HNSW: more is
slower and closer to exact) are set when it is built, kept in the faiss file and dense.json, and may be
changed when it is loaded. An index that trains (IVF, PQ) trains on a seeded sample of the encoded
vectors, read from the shards on disk (``train_size`` rows, by default the 256 per IVF list that faiss
itself would sample), so the corpus never sits in memory at once. The faiss file is faiss's own binary
format (no pickle). ``dense/`` appears only when complete (written to a temporary sibling and renamed).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from emapg.atomic import folder_atomic, open_lock, write_error, write_json_atomic
from emapg.data import DataError
from emapg.errors import ConfigError, MissingPackage
from emapg.retrieval import Passage, RetrieverError
from emapg.retrieval.embed import Embedder, weights_digest
from emapg.retrieval.passages import (
    DENSE_DIR,
    PASSAGES_FILE,
    Passages,
    passages_count_digest,
    passages_digest,
    read_meta,
    read_passages,
    stream_passages,
)
from emapg.retrieval.passages import DENSE_META as META_FILE

FORMAT_VERSION = 1
FAISS_FILE, PARTIAL_DIR = "index.faiss", ".dense.partial"


def _import_faiss():
    try:
        import faiss  # (optional: emapg[dense])
    except ImportError as e:
        raise MissingPackage(f"the dense retriever needs faiss-cpu and sentence-transformers ({e}); "
                          "install them with: pip install 'emapg[dense]'") from None
    return faiss


def set_search_params(index, params: dict | None, where: str) -> dict:
    """Set faiss search parameters (``{"nprobe": 32}``, ``{"efSearch": 128}``) on ``index``; returns them.
    Raises ValueError naming ``where`` for a parameter that is not a number or that this index lacks."""
    import faiss  # (optional: emapg[dense])

    if params is None:
        return {}
    if not isinstance(params, dict):
        raise ConfigError(f"{where}: search parameters must be a mapping of name to number, got {params!r}")
    space = faiss.ParameterSpace()
    for name, value in params.items():
        if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{where}: search parameter {name!r} must be a positive number, got {value!r}")
        try:
            space.set_index_parameter(index, str(name), float(value))
        except RuntimeError:
            raise ConfigError(f"{where}: this faiss index ({type(faiss.downcast_index(index)).__name__}) has no "
                             f"search parameter {name!r} (IVF indexes take nprobe, HNSW efSearch; "
                             "an exact Flat index takes none)") from None
    return dict(params)


def _training_sample(partial: Path, rows_of, shards: int, shard_size: int, size: int, seed: int) -> np.ndarray:
    """``size`` of the encoded vectors, a seeded uniform sample without replacement, gathered shard by shard
    from memory-mapped files (all of them, in order, when ``size`` covers the corpus)."""
    n = sum(rows_of(s) for s in range(shards))
    pick = np.arange(n) if size >= n else np.sort(np.random.default_rng(seed).choice(n, size, replace=False))
    parts = []
    for s in range(shards):
        lo = np.searchsorted(pick, s * shard_size)
        hi = np.searchsorted(pick, s * shard_size + rows_of(s))
        if hi > lo:
            parts.append(np.load(_shard_path(partial, s), mmap_mode="r")[pick[lo:hi] - s * shard_size])
    return np.ascontiguousarray(np.concatenate(parts), dtype=np.float32)


def _default_train_size(faiss, index, documents: int) -> int:
    """What faiss itself would train on: 256 vectors per IVF list (its k-means samples that many), at
    least 65,536 (a PQ codebook's own k-means of 256 centroids samples as many), never above the corpus."""
    try:
        lists = faiss.extract_index_ivf(index).nlist
    except RuntimeError:  # not an IVF index (PQ, PCA, ...)
        lists = 0
    return min(documents, max(256 * lists, 65_536))


def _shard_path(partial: Path, i: int) -> Path:
    return partial / f"shard-{i:06d}.npy"


def _save_shard(path: Path, vecs: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            np.save(f, vecs)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise (write_error(e, path) or e) from e  # a full disk: named
    os.replace(tmp, path)


def _good_shard(path: Path, rows: int, dim: int) -> bool:
    """Whether a saved shard reads back as ``rows`` float32 vectors of ``dim`` (a damaged one is encoded again)."""
    try:
        v = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError):
        return False
    return v.dtype == np.float32 and v.shape == (rows, dim)


def _partial_state(partial: Path, plan: dict, rows_of) -> int:
    """How many shards a previous build of the same plan finished and left intact (0: start afresh,
    debris removed); ``rows_of(s)`` is shard s's passage count."""
    if partial.is_dir():
        try:
            same = json.loads((partial / "plan.json").read_text()) == plan
        except (OSError, ValueError):
            same = False
        if same:
            done = 0
            while _good_shard(_shard_path(partial, done), rows_of(done), plan["dim"]):  # a missing one: OSError
                done += 1
            return done
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    write_json_atomic(partial / "plan.json", plan)
    return 0


def build_dense(index: str | Path, embedder: str | Embedder = "minilm", *, batch_size: int = 64,
                shard_size: int = 4096, factory: str = "Flat", progress: bool = True, device: str = "auto",
                search_params: dict | None = None, train_size: int | None = None, train_seed: int = 0) -> dict:
    """Encode the passages of the BM25 index folder ``index`` into ``index/dense/``; returns its metadata.

    Resumable: shards of ``shard_size`` passages are saved as they finish, and a build of the same passages
    with the same embedder, prefixes and shard size continues from them after a kill (a damaged shard is
    encoded again). One build at a time per folder (a lock says so). ``device``: where the embedder
    encodes (``auto``: the GPU when there is one). ``search_params``: faiss search parameters kept with
    the index (``{"nprobe": 32}``). ``train_size``: how many vectors an index that trains (IVF, PQ) trains
    on, sampled with ``train_seed`` (None: 256 per IVF list, at least 65,536, at most the corpus)."""
    index = Path(index)
    if not (index / PASSAGES_FILE).is_file():
        raise FileNotFoundError(f"{index} is not an emapg index folder (no {PASSAGES_FILE}); build the BM25 "
                                "index first: emapg index build --corpus FILE --out DIR")
    for name, value in (("shard_size", shard_size), ("batch_size", batch_size), ("train_size", train_size)):
        if (value is not None or name != "train_size") and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
    with open_lock(index / ".dense.lock") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RetrieverError(f"{index}: another dense index build is running there") from None
        return _build_locked(index, embedder, batch_size, shard_size, factory, progress, device,
                             search_params, train_size, train_seed)


def _build_locked(index: Path, embedder, batch_size: int, shard_size: int, factory: str, progress: bool,
                  device: str, search_params: dict | None, train_size: int | None, train_seed: int) -> dict:
    faiss = _import_faiss()
    start = time.perf_counter()
    if device == "auto":

        device = "cuda" if torch.cuda.is_available() else "cpu"
    emb = embedder if isinstance(embedder, Embedder) else Embedder(embedder, device=device)
    try:  # a wrong factory string fails here, before hours of encoding
        ix = faiss.index_factory(emb.dim, factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as e:
        raise ConfigError(f"factory {factory!r}: not a faiss index_factory string for {emb.dim} dimensions "
                         f"({str(e).strip().splitlines()[-1]})") from None
    search_params = set_search_params(ix, search_params, "search_params")  # a wrong one fails before encoding too
    passages = read_passages(index)
    if not len(passages):
        raise DataError(f"{index}/{PASSAGES_FILE}: no passages to encode")
    plan = {**emb.identity(), "passages_sha256": passages.sha256, "documents": len(passages),
            "shard_size": shard_size}
    partial = index / PARTIAL_DIR
    shards = -(-len(passages) // shard_size)
    rows_of = lambda s: min(shard_size, len(passages) - s * shard_size)  # noqa: E731
    done = _partial_state(partial, plan, rows_of)

    with tqdm(total=len(passages), initial=min(done * shard_size, len(passages)), unit="passage",
              desc=f"dense index ({emb.name})", disable=not progress) as bar:
        for s in range(done, shards):
            rows = range(s * shard_size, min((s + 1) * shard_size, len(passages)))
            _save_shard(_shard_path(partial, s), emb.encode([passages.contents(i) for i in rows], query=False,
                                                            batch_size=batch_size))
            bar.update(len(rows))
    trained = None
    if not ix.is_trained:  # IVF, PQ: trained on a sample, gathered from the shards on disk
        size = train_size or _default_train_size(faiss, ix, len(passages))
        sample = _training_sample(partial, rows_of, shards, shard_size, size, train_seed)
        ix.train(sample)
        trained = {"rows": len(sample), "seed": train_seed}
        del sample
    for s in range(shards):  # added shard by shard: one shard's vectors in memory beside the index
        ix.add(np.load(_shard_path(partial, s)))
    with folder_atomic(index / DENSE_DIR) as tmp:
        try:
            faiss.write_index(ix, str(tmp / FAISS_FILE))
        except RuntimeError as e:  # faiss's C++ write error (a full disk) names no folder
            raise OSError(errno.EIO, f"faiss could not write the index ({str(e).strip().splitlines()[-1]})",
                          str(index / DENSE_DIR)) from None
        meta = {"format_version": FORMAT_VERSION, **plan, "factory": factory, "faiss_version": faiss.__version__,
                "search_params": search_params, "trained_on": trained,
                "build_seconds": round(time.perf_counter() - start, 3)}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    shutil.rmtree(partial, ignore_errors=True)
    return meta


def import_dense(index: str | Path, faiss_file: str | Path, embedder: str, *, corpus: str | Path | None = None,
                 fields: dict[str, str] | None = None, query_prefix: str | None = None,
                 passage_prefix: str | None = None, link: bool = True) -> dict:
    """Take an existing faiss index (Search-R1's ``e5_Flat.index`` over ``wiki-18.jsonl``, built by its own
    scripts) as the folder's dense index, without encoding anything: row i of the faiss index must be passage i
    (the corpus file's order, which ``emapg index build`` keeps), encoded by ``embedder`` (its weights in a local
    folder; e5's ``query: `` prefix is recognised from its name, or give ``query_prefix``).

    The passages come from the folder (an ``emapg index build`` of the same corpus) or, with ``corpus``, are
    streamed from the corpus file into a new folder without a BM25 build (memory flat in the corpus's size: 8
    bytes a passage for the duplicate-id check); a BM25 index can be added later with ``emapg index build`` of
    the same corpus, which keeps this dense index. The faiss file is linked (``link``; copied otherwise), never
    rewritten; its size and dimension are checked against the passages and the embedder before anything is
    written."""
    faiss = _import_faiss()
    index, faiss_file = Path(index), Path(faiss_file)
    if corpus is None and not (index / PASSAGES_FILE).is_file():
        raise FileNotFoundError(f"{index} is not an emapg index folder (no {PASSAGES_FILE}); give the corpus "
                                "(--corpus wiki-18.jsonl) or build the folder from it first: emapg index build")
    if corpus is not None and index.exists() and any(index.iterdir()):
        raise FileExistsError(f"{index}: not empty; --corpus writes a new index folder (without --corpus the "
                              "folder's own passages are used)")
    if not faiss_file.is_file():
        raise FileNotFoundError(f"--faiss {faiss_file}: no such file")
    try:
        # memory-mapped, the vectors never read (IO_FLAG_MMAP_IFC maps a flat index's codes too; faiss >= 1.8)
        flags = faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY | getattr(faiss, "IO_FLAG_MMAP_IFC", 0)
        ix = faiss.read_index(str(faiss_file), flags)
    except RuntimeError as e:
        raise ConfigError(f"--faiss {faiss_file}: not a faiss index faiss can read "
                         f"({str(e).strip().splitlines()[-1]})") from None
    emb = Embedder(embedder, query_prefix=query_prefix, passage_prefix=passage_prefix)
    if ix.d != emb.dim:
        raise ConfigError(f"--faiss {faiss_file}: vectors of dimension {ix.d}, the embedder {emb.name!r} makes "
                         f"{emb.dim}")
    count, sha = _imported_passages(index, corpus, fields)
    if ix.ntotal != count:
        if corpus is not None:
            (index / PASSAGES_FILE).unlink()
        raise ConfigError(f"--faiss {faiss_file}: {ix.ntotal} vectors for the {count} passages of "
                         f"{corpus or index}: not an index of this corpus")
    meta = {"format_version": FORMAT_VERSION, **emb.identity(), "passages_sha256": sha,
            "documents": count, "factory": f"imported ({type(ix).__name__})",
            "faiss_version": faiss.__version__, "search_params": None, "trained_on": None,
            "imported_from": str(faiss_file.resolve()), "build_seconds": 0.0}
    with folder_atomic(index / DENSE_DIR) as tmp:
        if link:
            os.symlink(faiss_file.resolve(), tmp / FAISS_FILE)
        else:
            shutil.copyfile(faiss_file, tmp / FAISS_FILE)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return meta


def _imported_passages(index: Path, corpus: str | Path | None, fields: dict[str, str] | None) -> tuple[int, str]:
    """The passages' number and digest: the folder's, read without holding them, or the corpus's, streamed into
    the new folder's ``passages.jsonl`` (written under another name and renamed when complete)."""
    if corpus is None:
        return passages_count_digest(index)
    index.mkdir(parents=True, exist_ok=True)
    part = index / f".{PASSAGES_FILE}.part"
    try:
        count, sha = stream_passages(corpus, part, fields)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    part.replace(index / PASSAGES_FILE)
    return count, sha


def _on_gpus(faiss, ix) -> tuple[object, str]:
    """The index copied to every visible GPU (sharded, as Search-R1's server does with ``faiss_gpu``) when faiss
    is a GPU build with GPUs; otherwise the index itself, on the CPU."""
    gpus = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
    if not gpus or not hasattr(faiss, "index_cpu_to_all_gpus"):
        return ix, "cpu (this faiss has no GPU support: pip install faiss-gpu for a GPU index)"
    options = faiss.GpuMultipleClonerOptions()
    options.shard = True
    return faiss.index_cpu_to_all_gpus(ix, co=options), f"{gpus} GPU(s)"


class DenseIndex:
    """A loaded dense index; ``search`` is safe to call from many threads (encoding is serialised)."""

    def __init__(self, path: Path, faiss_index, embedder: Embedder, passages, meta: dict,
                 search_params: dict | None = None, faiss_device: str = "cpu"):
        self.path, self.meta, self.embedder = path, meta, embedder
        self._index, self._passages = faiss_index, passages
        self.search_params = {**(meta.get("search_params") or {}), **(search_params or {})}
        self.devices = f"queries encoded on {embedder.device}, faiss index on {faiss_device}"
        self._lock = threading.Lock()

    @classmethod
    def load(cls, path: str | Path, embedder: str | None = None, passages: Passages | None = None,
             search_params: dict | None = None, device: str = "cpu") -> DenseIndex:
        """Load ``path/dense`` (``path`` the index folder). ``embedder`` overrides where the recorded
        embedder is found (a moved folder); its weights must be the ones the passages were encoded with.
        ``passages``: the folder's passages when already read (a hybrid retriever shares BM25's).
        ``search_params``: faiss search parameters over the ones it was built with (``{"nprobe": 64}``).
        ``device``: where queries are encoded; on a GPU the faiss index is copied to every GPU when faiss is
        a GPU build (search parameters set before the copy), else it stays on the CPU (``devices`` says)."""
        faiss = _import_faiss()
        path = Path(path)
        dense = path / DENSE_DIR
        link = dense / FAISS_FILE
        if link.is_symlink() and not link.exists():  # an imported index whose file moved: nothing to re-encode
            raise FileNotFoundError(f"{link} links to {os.readlink(link)}, which is gone: put the faiss file back, or "
                                    f"take it again from where it is: emapg index import-dense --index {path} "
                                    "--faiss FILE --embedder DIR")
        if not (dense / META_FILE).is_file() or not (dense / FAISS_FILE).is_file():
            raise FileNotFoundError(f"{path} has no dense index ({DENSE_DIR}/{META_FILE} and "
                                    f"{DENSE_DIR}/{FAISS_FILE}); build one with: emapg index dense --index {path}")
        meta = read_meta(dense / META_FILE)
        if meta.get("format_version") != FORMAT_VERSION:
            raise DataError(f"{dense}: unsupported dense index format {meta.get('format_version')!r} "
                             f"(this emapg reads version {FORMAT_VERSION}); rebuild it")
        if passages is None:
            passages = read_passages(path)  # read and hashed in one pass
        if (passages.sha256 or passages_digest(path)) != meta["passages_sha256"]:
            raise DataError(f"{dense}: encoded from other passages than {path / PASSAGES_FILE} holds now; "
                             f"rebuild it: emapg index dense --index {path}")
        emb = Embedder(embedder or meta["embedder"], query_prefix=meta["query_prefix"],
                       passage_prefix=meta["passage_prefix"], device=device)
        if weights_digest(emb.folder) != meta["weights_sha256"]:
            raise DataError(f"{dense}: its passages were encoded by other weights than embedder "
                             f"{emb.name!r} ({emb.folder}) holds; rebuild it or give the embedder it was built with")
        try:
            ix = faiss.read_index(str(dense / FAISS_FILE))
        except RuntimeError as e:  # faiss's C++ read error: a truncated or foreign file
            why = str(e).strip().splitlines()[-1]
            raise DataError(f"{dense / FAISS_FILE}: damaged, faiss cannot read it ({why}); "
                             f"rebuild it: emapg index dense --index {path}") from None
        if ix.ntotal != len(passages) or ix.d != emb.dim:
            raise DataError(f"{dense}: {ix.ntotal} vectors of dimension {ix.d} for {len(passages)} passages and "
                             f"a {emb.dim}-dimensional embedder; rebuild it")
        params = set_search_params(ix, search_params, f"{dense}: search_params")
        ix, faiss_device = _on_gpus(faiss, ix) if device.startswith("cuda") else (ix, "cpu")
        return cls(path, ix, emb, passages, meta, params, faiss_device)

    def __len__(self) -> int:
        return len(self._passages)

    def __repr__(self) -> str:
        params = f", search_params={self.search_params}" if self.search_params else ""
        return f"DenseIndex({str(self.path)!r}, documents={len(self)}, embedder={self.embedder.name!r}{params})"

    def search(self, queries: list[str], topk: int = 3) -> list[list[Passage]]:
        """The ``topk`` passages nearest each query (cosine), best first; an empty query gets none."""
        if isinstance(queries, str):
            raise TypeError("search takes a list of queries, not a single string")
        if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1:
            raise ValueError(f"topk must be an integer >= 1, got {topk!r}")
        for q in queries:
            if not isinstance(q, str):
                raise TypeError(f"queries must be strings, got {type(q).__name__}")
        asked = [i for i, q in enumerate(queries) if q.strip()]
        results: list[list[Passage]] = [[] for _ in queries]
        if not asked:
            return results
        with self._lock:  # one encoder, shared: torch's forward is not re-entrant on one module
            vecs = self.embedder.encode([queries[i] for i in asked], query=True)
        scores, rows = self._index.search(vecs, min(topk, len(self._passages)))
        p = self._passages
        for i, sc, rw in zip(asked, scores, rows, strict=True):
            results[i] = [Passage(p.ids[r], p.titles[r], p.texts[r], float(s))
                          for s, r in zip(sc, rw, strict=True) if r >= 0]
        return results
