"""Peak memory of taking a prebuilt faiss index (Search-R1's e5_Flat.index over wiki-18.jsonl) as a dense index,
at two corpus sizes, side by side: `emapg index import-dense --corpus` (the corpus streamed into the folder's
passages, no BM25) against the way it needed before 2026-12-06 (`emapg index build` of the whole corpus, then
`import-dense` into that folder).

    python bench/import_dense_memory.py [--sizes 50000,200000] [--out docs/results/import_dense_memory.json]

The corpus is synthetic: Search-R1's `{id, contents}` rows of about 100 words (wiki-18's passages are 100-word
chunks); the faiss file a Flat inner-product index of random 384-dimensional vectors (the packaged MiniLM's
width; the import reads only its header, memory-mapped). Each measurement runs in a process of its own and
reports the peak resident memory above its level after the imports and the embedder's load (sampled every 2 ms).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import PeakRSS, commit, machine, worker_env

WORDS = ("the river valley kingdom ancient empire northern coast island mountain battle treaty city council "
         "church bishop merchant guild harbour fortress village county province festival library poet painter "
         "composer symphony railway station bridge canal museum garden university college professor physicist "
         "chemist theory element reactor satellite orbit comet planet season harvest market currency").split()


def make_corpus(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            title = " ".join(rng.choice(WORDS).title() for _ in range(2))
            text = " ".join(rng.choice(WORDS) for _ in range(100))
            f.write(json.dumps({"id": str(i), "contents": f'"{title}"\n{text}'}) + "\n")


def make_faiss(path: Path, n: int, dim: int = 384) -> None:
    import faiss
    import numpy as np

    ix = faiss.IndexFlatIP(dim)
    rng = np.random.default_rng(0)
    for start in range(0, n, 50_000):
        ix.add(rng.standard_normal((min(50_000, n - start), dim), dtype=np.float32))
    faiss.write_index(ix, str(path))


def worker(mode: str, corpus: Path, faiss_file: Path, out: Path) -> None:
    from emapg.retrieval.bm25 import _import_bm25s, build_index
    from emapg.retrieval.dense import _import_faiss, import_dense
    from emapg.retrieval.embed import Embedder

    _import_bm25s(), _import_faiss(), Embedder("minilm")  # imports and the embedder's load: below the base line
    start = time.perf_counter()
    with PeakRSS() as peak:
        if mode == "streamed":
            import_dense(out / "index", faiss_file, "minilm", corpus=corpus)
        else:
            build_index(corpus, out / "index")
            import_dense(out / "index", faiss_file, "minilm")
    print(json.dumps({"extra_mb": peak.extra, "base_mb": peak.base, "seconds": time.perf_counter() - start}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="50000,200000")
    ap.add_argument("--out", help="write the measurements as JSON here")
    args = ap.parse_args()
    env = worker_env()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(s) for s in args.sizes.split(",")]:
            corpus, faiss_file = Path(tmp) / f"wiki-{n}.jsonl", Path(tmp) / f"flat-{n}.index"
            make_corpus(corpus, n)
            make_faiss(faiss_file, n)
            for mode in ("build+import", "streamed"):
                out = Path(tmp) / f"{mode}-{n}"
                out.mkdir()
                res = subprocess.run([sys.executable, __file__, "--worker", mode, str(corpus), str(faiss_file),
                                      str(out)], env=env, check=True, capture_output=True, text=True)
                row = {"mode": mode, "passages": n, "corpus_mb": corpus.stat().st_size / 2**20,
                       **json.loads(res.stdout.strip().splitlines()[-1])}
                results.append(row)
                print(f"{mode:12s} {n:7d} passages ({row['corpus_mb']:.0f} MiB corpus): +{row['extra_mb']:7.1f} MiB "
                      f"in {row['seconds']:.1f} s", flush=True)
    print("\n| passages | corpus file | build + import: peak above base | streamed import: peak above base |\n"
          "|---|---|---|---|")
    for n in sorted({r["passages"] for r in results}):
        by = {r["mode"]: r for r in results if r["passages"] == n}
        print(f"| {n:,} | {by['streamed']['corpus_mb']:.0f} MiB | {by['build+import']['extra_mb']:.0f} MiB "
              f"({by['build+import']['seconds']:.0f} s) | {by['streamed']['extra_mb']:.0f} MiB "
              f"({by['streamed']['seconds']:.0f} s) |")
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine(), "commit": commit(), "results": results},
                                             indent=1) + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[5]))
    else:
        main()
