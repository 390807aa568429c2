"""Recall@k of BM25, dense (MiniLM + faiss) and hybrid (reciprocal-rank fusion) retrieval, side by side
in one run, and the dense encoder's speed.

Two corpora:

* the generated knowledge base the search agent trains on (``emapg kb make``): each two-hop question's
  two support passages, found by the searches an agent makes. ``hop 1``: the question itself must
  retrieve the first support passage; ``hop 2 (name)``: the bridge entity's name (what the agent searches
  next, "<search> Kadrin </search>"); ``hop 2 (question)``: the follow-up asked as a question ("In which
  country is Kadrin?" / "In which city was Mira Tolk born?"); ``hop 2 (typo)``: the name with two
  adjacent letters swapped (a small policy copies the invented names it reads imperfectly).
* the Wikipedia sample (``tests/fixtures/corpus/flashrag_wiki_sample.jsonl``, 1000 passages, in the repository): a
  passage's title as the query, for titles that name one passage only, and the same title with a typo.

    python bench/retrieval_recall.py                 # all of it (a few minutes on 2 cores)
    python bench/retrieval_recall.py --k 1 3 5 10 --json out.json
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import commit, machine

ROOT = Path(__file__).resolve().parents[1]
WIKI = ROOT / "tests" / "fixtures" / "corpus" / "flashrag_wiki_sample.jsonl"
KINDS = ("bm25", "dense", "hybrid")


def typo(text: str, rng: random.Random) -> str:
    """``text`` with two adjacent letters swapped inside one of its words of 4+ letters (unchanged if none)."""
    words = text.split(" ")
    long = [i for i, w in enumerate(words) if len(w) >= 4 and w.isalpha()]
    if not long:
        return text
    i = rng.choice(long)
    w = words[i]
    spots = [j for j in range(1, len(w) - 2) if w[j] != w[j + 1]] or [0]
    j = rng.choice(spots)
    words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


def kb_queries(kb: dict) -> dict[str, list[tuple[str, str]]]:
    """(query, title of the passage that must be retrieved) for each probe of the generated KB."""
    texts = {d["title"]: d["text"] for d in kb["corpus"]}
    rows = kb["eval"] + kb["train"]
    probes: dict[str, list[tuple[str, str]]] = {"hop 1": [], "hop 2 (name)": [], "hop 2 (question)": [],
                                                "hop 2 (typo)": []}
    rng = random.Random(0)
    for r in rows:
        first, bridge = r["support"]
        probes["hop 1"].append((r["question"], first))
        probes["hop 2 (name)"].append((bridge, bridge))
        follow = (f"In which country is {bridge}?" if r["question"].startswith("In which country")
                  else f"In which city was {bridge} born?")
        probes["hop 2 (question)"].append((follow, bridge))
        probes["hop 2 (typo)"].append((typo(bridge, rng), bridge))
        assert bridge in texts[first], (first, bridge)
    return probes


def wiki_queries(corpus: Path) -> dict[str, list[tuple[str, str]]]:
    rows = [json.loads(line) for line in corpus.read_text(encoding="utf-8").splitlines() if line.strip()]
    counts = collections.Counter(r["title"] for r in rows)
    titles = [r["title"] for r in rows if counts[r["title"]] == 1]
    rng = random.Random(0)
    typos = [(typo(t, rng), t) for t in titles]
    return {"title": [(t, t) for t in titles], "title (typo)": [(q, t) for q, t in typos if q != t]}


def recall(retriever, probes: list[tuple[str, str]], ks: list[int]) -> dict[int, float]:
    hits = retriever.search([q for q, _ in probes], topk=max(ks))
    return {k: 100.0 * sum(t in [p.title for p in h[:k]] for (_, t), h in zip(probes, hits, strict=True))
            / len(probes) for k in ks}


def build(corpus_rows: list[dict] | Path, folder: Path, embedder) -> dict:
    from emapg.retrieval.bm25 import build_index
    from emapg.retrieval.dense import build_dense

    if isinstance(corpus_rows, Path):
        corpus = corpus_rows
    else:
        corpus = folder / "corpus.jsonl"
        corpus.write_text("".join(json.dumps(d) + "\n" for d in corpus_rows), encoding="utf-8")
    t0 = time.perf_counter()
    build_index(corpus, folder / "index")
    t_bm25 = time.perf_counter() - t0
    meta = build_dense(folder / "index", embedder, progress=False)
    return {"passages": meta["documents"], "bm25_build_s": t_bm25, "dense_build_s": meta["build_seconds"]}


def query_speed(retriever, queries: list[str], repeats: int = 3) -> float:
    """Median queries per second over ``repeats`` batched passes."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        retriever.search(queries, topk=3)
        times.append(time.perf_counter() - t0)
    return len(queries) / statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, nargs="+", default=[1, 3, 5])
    ap.add_argument("--embedder", default="minilm")
    ap.add_argument("--kb-seed", type=int, default=0)
    ap.add_argument("--no-wiki", action="store_true", help="skip the Wikipedia sample")
    ap.add_argument("--json", help="also write the numbers here (recall in percent, per corpus, probe, retriever, k)")
    args = ap.parse_args(argv)

    from emapg.retrieval import open_retriever
    from emapg.retrieval.embed import Embedder
    from emapg.tasks.multihop_kb import make_kb

    t0 = time.perf_counter()
    embedder = Embedder(args.embedder)
    load_s = time.perf_counter() - t0
    out: dict = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "commit": commit(),
                 "command": "python bench/retrieval_recall.py " + " ".join(sys.argv[1:] if argv is None else argv),
                 "embedder": embedder.identity(), "embedder_load_s": load_s, "k": args.k, "corpora": {}}
    kb = make_kb(seed=args.kb_seed)
    corpora = {"generated KB": (kb["corpus"], kb_queries(kb))}
    if not args.no_wiki:
        if not WIKI.is_file():
            sys.exit(f"retrieval_recall: the Wikipedia sample {WIKI} is not there (it ships in the repository); "
                     "--no-wiki measures the generated corpus alone")
        corpora["Wikipedia sample"] = (WIKI, wiki_queries(WIKI))
    with tempfile.TemporaryDirectory() as tmp:
        for name, (rows, probes) in corpora.items():
            folder = Path(tmp) / name.replace(" ", "_")
            folder.mkdir()
            info = build(rows, folder, embedder)
            retrievers = {k: open_retriever(index=str(folder / "index"), kind=k) for k in KINDS}
            queries = [q for ps in probes.values() for q, _ in ps][:512]
            info["queries_per_s"] = {k: query_speed(r, queries) for k, r in retrievers.items()}
            info["recall"] = {p: {k: recall(r, ps, args.k) for k, r in retrievers.items()} for p, ps in probes.items()}
            info["probes"] = {p: len(ps) for p, ps in probes.items()}
            out["corpora"][name] = info

    print(f"embedder {args.embedder}: {embedder.folder} ({embedder.dim} dimensions, loaded in {load_s:.1f} s)")
    head = " | ".join(f"{k} R@{n}" for k in KINDS for n in args.k)
    print(f"\n| corpus | probe (queries) | {head} |")
    print("|---|---|" + "---:|" * (len(KINDS) * len(args.k)))
    for name, info in out["corpora"].items():
        for probe, by_kind in info["recall"].items():
            cells = " | ".join(f"{by_kind[k][n]:.1f}" for k in KINDS for n in args.k)
            print(f"| {name} | {probe} ({info['probes'][probe]}) | {cells} |")
    print("\n| corpus | passages | BM25 build s | dense build s (passages/s) | queries/s bm25 | dense | hybrid |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, info in out["corpora"].items():
        q = info["queries_per_s"]
        print(f"| {name} | {info['passages']} | {info['bm25_build_s']:.2f} | {info['dense_build_s']:.1f} "
              f"({info['passages'] / info['dense_build_s']:.0f}) | {q['bm25']:.0f} | {q['dense']:.0f} | "
              f"{q['hybrid']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
