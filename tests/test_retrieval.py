"""Retrieval: the embedded BM25 index, the Search-R1 compatible server and its client."""

from __future__ import annotations

import collections
import http.client
import json
import random
import socket
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("bm25s")
pytest.importorskip("Stemmer")

from emapg.data import DataError  # noqa: E402
from emapg.retrieval import Passage, RetrieverError, open_retriever  # noqa: E402
from emapg.retrieval.bm25 import BM25Index, build_index  # noqa: E402
from emapg.retrieval.client import HTTPRetriever, parse_contents  # noqa: E402
from emapg.retrieval.server import make_server  # noqa: E402

SAMPLE = Path(__file__).resolve().parent / "fixtures" / "corpus" / "flashrag_wiki_sample.jsonl"  # Wikipedia

CORPUS = [
    {"id": "p1", "title": "Zorvath Kellbrook",
     "text": "Zorvath Kellbrook was a glassblower from the river town of Mellowfen who invented the spiral lantern."},
    {"id": "p2", "title": "Quillmarsh Abbey",
     "text": "Quillmarsh Abbey is a ruined monastery on the cliffs of Dornhaven, famous for its bell tower."},
    {"id": "p3", "title": "Tessaly Varn",
     "text": "Tessaly Varn composed the Ember Sonatas for harp and was born in the mountain village of Ostrelle."},
    {"id": "p4", "title": "Brimwater Canal",
     "text": "The Brimwater Canal links Lake Harrowmere to the port of Skellgate and carries barges of salt."},
    {"id": "p5", "title": "Orlina Petrosk",
     "text": "Orlina Petrosk was an astronomer who catalogued the comets visible from the Veyland observatory."},
    {"id": "p6", "title": "Fennick Derrow",
     "text": "Fennick Derrow captained the airship Halcyon across the Grey Steppe during the winter expedition."},
    {"id": 7, "title": "Mossgrave Festival",
     "text": "The Mossgrave Festival celebrates the mushroom harvest with lantern parades every autumn."},
    {"id": "p8",
     "text": "Ulvane cheese is a blue cheese aged in the limestone caves beneath the hills of Crennock."},
]
# (query, id of the passage that must rank first)
QUERIES = [
    ("who invented the spiral lantern", "p1"),
    ("ruined monastery bell tower Dornhaven", "p2"),
    ("composer of the Ember Sonatas", "p3"),
    ("canal from Lake Harrowmere to Skellgate", "p4"),
    ("astronomer who catalogued comets", "p5"),
    ("airship Halcyon captain", "p6"),
    ("mushroom harvest festival", "7"),
    ("blue cheese aged in limestone caves", "p8"),
]
LIMITS = {"max_queries": 12, "max_query_chars": 200, "max_topk": 10, "max_body_bytes": 4096}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bm25")
    meta = build_index(write_jsonl(d / "corpus.jsonl", CORPUS), d / "index")
    assert meta["documents"] == len(CORPUS) and meta["format_version"] == 1 and meta["stemmer"] == "english"
    assert meta.pop("dense") is None  # what became of a dense index there: none was
    assert json.loads((d / "index" / "emapg_index.json").read_text()) == meta
    return d / "index"


@pytest.fixture(scope="module")
def index(index_dir) -> BM25Index:
    return BM25Index.load(index_dir)


def start_server(retriever, **limits):
    server = make_server(retriever, "127.0.0.1", 0, **limits)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    host, port = server.server_address[:2]

    def stop():
        server.shutdown()
        server.server_close()
        thread.join(5)

    return f"http://{host}:{port}", stop


@pytest.fixture(scope="module")
def server_url(index):
    url, stop = start_server(index, **LIMITS)
    yield url
    stop()


def request(url: str, body: bytes | dict | None = None, method: str = "POST") -> tuple[int, dict]:
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=20) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# --- the embedded index -------------------------------------------------------------------------------------

def test_index_ranks_the_right_passage_first(index):
    assert len(index) == len(CORPUS)
    results = index.search([q for q, _ in QUERIES], topk=3)
    assert [hits[0].id for hits in results] == [pid for _, pid in QUERIES]
    for hits in results:
        assert 1 <= len(hits) <= 3
        assert all(isinstance(p, Passage) and isinstance(p.score, float) and p.score > 0 for p in hits)
        assert [p.score for p in hits] == sorted((p.score for p in hits), reverse=True)
    top = results[0][0]
    assert (top.title, top.text) == (CORPUS[0]["title"], CORPUS[0]["text"])
    assert top.contents == f'"Zorvath Kellbrook"\n{CORPUS[0]["text"]}'
    p8 = index.search(["Ulvane cheese"], topk=1)[0][0]
    assert p8.id == "p8" and p8.title == "" and p8.contents == CORPUS[7]["text"]


def test_index_topk_bounds_and_empty_queries(index):
    (hits,) = index.search(["the lantern of the town"], topk=100)
    assert 1 <= len(hits) <= len(CORPUS) and len({p.id for p in hits}) == len(hits)
    assert {p.id for p in hits} >= {"p1", "7"}
    (every,) = index.search(["Zorvath Brimwater Tessaly Quillmarsh Orlina Fennick Mossgrave Ulvane"], topk=50)
    assert len(every) == len(CORPUS)
    assert index.search(["", "   ", "the of and is a", "xyzzyplugh qwertyuiop", "!!"], topk=5) == [[]] * 5
    assert index.search([], topk=3) == []
    for bad in (0, -1):
        with pytest.raises(ValueError, match="topk"):
            index.search(["lantern"], topk=bad)
    with pytest.raises(TypeError):
        index.search("lantern")  # type: ignore[arg-type]


def test_index_search_from_many_threads(index):
    queries = [q for q, _ in QUERIES] * 8
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda q: index.search([q], topk=2)[0][0].id, queries))
    assert got == [pid for _, pid in QUERIES] * 8


def test_build_errors_name_file_line_and_field(tmp_path):
    missing = write_jsonl(tmp_path / "missing.jsonl", [CORPUS[0], {"id": "x", "title": "No text"}])
    with pytest.raises(DataError) as e:
        build_index(missing, tmp_path / "i1")
    assert str(missing) in str(e.value) and "line 2" in str(e.value) and "'text'" in str(e.value)

    malformed = write_jsonl(tmp_path / "malformed.jsonl", [CORPUS[0], CORPUS[1], '{"id": "x", "text": '])
    with pytest.raises(DataError, match=r"malformed\.jsonl, line 3: malformed JSON"):
        build_index(malformed, tmp_path / "i2")

    dup = write_jsonl(tmp_path / "dup.jsonl", [CORPUS[0], CORPUS[1], {**CORPUS[2], "id": "p1"}])
    with pytest.raises(DataError, match="duplicate id 'p1'"):
        build_index(dup, tmp_path / "i3")
    # a lone surrogate (JSON allows it, no tokenizer encodes it) is named with its line, not an encode error
    broken = tmp_path / "surrogate.jsonl"
    broken.write_text(json.dumps(CORPUS[0]) + "\n" + '{"id": "s", "title": "T", "text": "bad \\ud83d here"}\n')
    with pytest.raises(DataError, match=r"surrogate\.jsonl, line 2: not valid Unicode text"):
        build_index(broken, tmp_path / "i4")
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temporary folders left behind


def test_build_replaces_an_index_only_after_success(tmp_path):
    out = tmp_path / "index"
    build_index(write_jsonl(tmp_path / "a.jsonl", CORPUS[:3]), out)
    assert build_index(write_jsonl(tmp_path / "b.jsonl", CORPUS), out)["documents"] == len(CORPUS)
    dup = write_jsonl(tmp_path / "dup.jsonl", [CORPUS[0], CORPUS[0]])
    with pytest.raises(DataError):
        build_index(dup, out)
    assert len(BM25Index.load(out)) == len(CORPUS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "b.jsonl", "dup.jsonl", "index"]

    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        build_index(tmp_path / "a.jsonl", other)
    assert (other / "keep.txt").read_text() == "mine"
    with pytest.raises(FileNotFoundError, match="emapg_index.json"):
        BM25Index.load(other)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        BM25Index.load(tmp_path / "nowhere")


def test_wikipedia_passages_title_queries(tmp_path):
    meta = build_index(SAMPLE, tmp_path / "wiki")
    index = BM25Index.load(tmp_path / "wiki")
    assert meta["documents"] == len(index) == 1000
    rows = [json.loads(line) for line in SAMPLE.read_text(encoding="utf-8").splitlines() if line.strip()]
    counts = collections.Counter(r["title"] for r in rows)
    unique = [r for r in rows if counts[r["title"]] == 1]
    results = index.search([r["title"] for r in unique], topk=3)
    found = {r["id"] for r, hits in zip(unique, results, strict=True) if r["id"] in [p.id for p in hits]}
    assert {"0", "106"} <= found
    assert len(found) >= 0.95 * len(unique)
    evan = results[[r["id"] for r in unique].index("0")][0]
    assert (evan.id, evan.title) == ("0", "Evan Morris") and evan.text == rows[0]["text"]


# --- the server ----------------------------------------------------------------------------------------------

def test_server_search_r1_shape(server_url, index):
    status, body = request(server_url + "/retrieve", {"queries": [QUERIES[0][0], QUERIES[4][0]], "topk": 2,
                                                      "return_scores": True})
    assert status == 200 and len(body["result"]) == 2
    expected = index.search([QUERIES[0][0], QUERIES[4][0]], topk=2)
    for hits, want in zip(body["result"], expected, strict=True):
        assert [h["document"] for h in hits] == [{"id": p.id, "contents": p.contents} for p in want]
        assert [h["score"] for h in hits] == pytest.approx([p.score for p in want])
    assert body["result"][0][0]["document"]["id"] == "p1"

    status, body = request(server_url + "/retrieve", {"queries": [QUERIES[6][0]]})  # topk 3, no scores
    assert status == 200
    (hits,) = body["result"]
    assert hits[0] == {"id": "7", "contents": f'"Mossgrave Festival"\n{CORPUS[6]["text"]}'}
    assert len(hits) <= 3 and all(set(h) == {"id", "contents"} for h in hits)
    status, body = request(server_url + "/retrieve/", {"queries": ["the of", "Ulvane"], "topk": 1})
    assert status == 200 and body["result"][0] == [] and body["result"][1][0]["id"] == "p8"


@pytest.mark.parametrize(("payload", "field"), [
    (b"{not json", "malformed JSON"),
    (b"[1, 2]", "JSON object"),
    ({"topk": 3}, "'queries'"),
    ({"queries": "lantern"}, "'queries'"),
    ({"queries": ["ok", 5]}, "item 1"),
    ({"queries": []}, "empty"),
    ({"queries": ["q"] * 13}, "at most 12 per request"),
    ({"queries": ["ok", "x" * 201]}, "query 1"),
    ({"queries": ["q"], "topk": 0}, "'topk'"),
    ({"queries": ["q"], "topk": 11}, "'topk'"),
    ({"queries": ["q"], "topk": "3"}, "'topk'"),
    ({"queries": ["q"], "return_scores": "yes"}, "'return_scores'"),
    (b'{"queries": ["ok", "bad \\ud800 one"]}', "query 1 holds a lone surrogate"),  # (it was a 500)
])
def test_server_rejects_bad_requests(server_url, payload, field):
    status, body = request(server_url + "/retrieve", payload)
    assert status == 400 and field in body["error"]
    over_a_limit = field in ("at most 12 per request", "query 1")
    assert body.get("limits") == (LIMITS if over_a_limit else None)  # a refusal for a limit states them all


def test_server_http_errors(server_url):
    status, body = request(server_url + "/retrieve", {"queries": ["x" * 150] * 8, "pad": "y" * 3000})
    assert status == 413 and "4096" in body["error"]
    assert request(server_url + "/nowhere", {"queries": ["q"]})[0] == 404
    assert request(server_url + "/nowhere", method="GET")[0] == 404
    status, body = request(server_url + "/retrieve", method="GET")
    assert status == 405 and "POST" in body["error"]
    assert request(server_url + "/health", method="GET") == (200, {"status": "ok", "documents": len(CORPUS),
                                                                   "limits": LIMITS})

    host, port = server_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:  # a huge Content-Length is refused from the headers alone
        conn.putrequest("POST", "/retrieve")
        conn.putheader("Content-Length", str(1 << 30))
        conn.endheaders()
        resp = conn.getresponse()
        assert resp.status == 413 and "error" in json.loads(resp.read())
    finally:
        conn.close()
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.putrequest("POST", "/retrieve", skip_accept_encoding=True)
        conn.endheaders()
        resp = conn.getresponse()
        assert resp.status == 411 and "Content-Length" in json.loads(resp.read())["error"]
    finally:
        conn.close()
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:  # a Content-Length that is not a number is named
        conn.putrequest("POST", "/retrieve", skip_accept_encoding=True)
        conn.putheader("Content-Length", "abc")
        conn.endheaders()
        resp = conn.getresponse()
        assert resp.status == 400 and json.loads(resp.read())["error"] == "invalid HTTP request: bad Content-Length"
    finally:
        conn.close()


def test_server_keeps_connections_alive(server_url):
    host, port = server_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        for (q, pid), bad in zip(QUERIES[:3], (b"{", b"[]", b"{}"), strict=True):
            conn.request("POST", "/retrieve", body=bad, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 400 and json.loads(resp.read())["error"]
            conn.request("POST", "/retrieve", body=json.dumps({"queries": [q], "topk": 1}))
            resp = conn.getresponse()
            assert resp.status == 200 and json.loads(resp.read())["result"][0][0]["id"] == pid
    finally:
        conn.close()


def test_server_under_200_concurrent_requests(server_url):
    rng = random.Random(0)
    jobs = [rng.sample(QUERIES, rng.randint(1, 3)) for _ in range(200)]

    def one(job):
        return request(server_url + "/retrieve", {"queries": [q for q, _ in job], "topk": 2})

    with ThreadPoolExecutor(64) as pool:
        answers = list(pool.map(one, jobs))
    for job, (status, body) in zip(jobs, answers, strict=True):
        assert status == 200
        assert [hits[0]["id"] for hits in body["result"]] == [pid for _, pid in job]


# --- the client ------------------------------------------------------------------------------------------------

def test_http_retriever_matches_the_index(server_url, index):
    queries = [q for q, _ in QUERIES] + ["the of", "lantern"]
    for url in (server_url, server_url + "/", server_url + "/retrieve"):
        got = HTTPRetriever(url).search(queries, topk=4)
        want = index.search(queries, topk=4)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert [(p.id, p.title, p.text) for p in g] == [(p.id, p.title, p.text) for p in w]
            assert all(abs(a.score - b.score) < 1e-6 for a, b in zip(g, w, strict=True))
    assert HTTPRetriever(server_url).search([]) == []
    assert parse_contents('"A title"\nbody\nmore') == ("A title", "body\nmore")
    assert parse_contents("no title here") == ("", "no title here")


def test_http_retriever_errors(server_url):
    with pytest.raises(RetrieverError, match="'topk' must be an integer in \\[1, 10\\]"):
        HTTPRetriever(server_url).search(["lantern"], topk=11)
    (hits,) = HTTPRetriever(server_url).search(["spiral lantern glassblower " + "x" * 300])  # cut to 200 characters
    assert hits and hits[0].id == "p1"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(RetrieverError, match=f"{closed}/retrieve failed after 2 attempts"):
        HTTPRetriever(closed, retries=1, backoff=0.01).search(["lantern"])
    with pytest.raises(ValueError):
        HTTPRetriever("localhost:8000")


def test_http_retriever_retries_server_errors(index):
    class Flaky:
        calls = 0

        def search(self, queries, topk=3):
            Flaky.calls += 1
            if Flaky.calls == 1:
                raise RuntimeError("index warming up")
            return index.search(queries, topk)

    url, stop = start_server(Flaky())
    try:
        (hits,) = HTTPRetriever(url, retries=2, backoff=0.01).search([QUERIES[1][0]], topk=1)
        assert hits[0].id == "p2" and Flaky.calls == 2
        status, body = request(url + "/health", method="GET")
        assert status == 200 and body["status"] == "ok" and "documents" not in body
    finally:
        stop()


def test_open_retriever(index_dir, server_url):
    local = open_retriever(index=str(index_dir))
    remote = open_retriever(url=server_url)
    assert isinstance(local, BM25Index) and isinstance(remote, HTTPRetriever)
    q = [QUERIES[2][0]]
    assert [p.id for p in local.search(q)[0]] == [p.id for p in remote.search(q)[0]]
    for kwargs in ({}, {"index": str(index_dir), "url": server_url}):
        with pytest.raises(ValueError, match="exactly one"):
            open_retriever(**kwargs)


def test_a_number_of_more_digits_than_python_reads_is_a_bad_request(index):
    url, stop = start_server(index, max_body_bytes=20_000)
    try:
        huge = b'{"queries": ["a"], "topk": ' + b"9" * 5000 + b"}"  # Python converts at most 4,300 digits
        status, body = request(url + "/retrieve", huge)
        assert status == 400 and "malformed JSON body" in body["error"]
    finally:
        stop()


def test_server_errors_are_json_for_every_status(server_url):
    host, port = server_url.removeprefix("http://").split(":")
    deep = b'{"queries": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, body = request(server_url + "/retrieve", deep)
    assert status in (400, 413) and "error" in body
    status, body = request(server_url + "/retrieve", b'{"queries": ' + b"[" * 1500 + b"]" * 1500 + b"}")
    assert status == 400 and ("nested too deeply" in body["error"] or "must be" in body["error"])
    for method in ("DELETE", "BREW"):
        status, body = request(server_url + "/retrieve", method=method)
        assert status == 405 and "use POST" in body["error"]
    with socket.create_connection((host, int(port))) as s:  # not HTTP at all
        s.sendall(b"this is not a request\r\n\r\n")
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
        reply = reply.decode()
    assert reply.startswith("HTTP/1.1 400") and '{"error": ' in reply


def test_200_valid_requests_succeed_while_300_idle_and_slow_connections_are_held(index, bench_module):
    """The server's connections cost no thread each, and its header deadline closes the clients that
    drip or say nothing (bench/retriever_load.py prints the same measurement)."""
    load = bench_module("retriever_load")
    url, stop = start_server(index, header_timeout=1.0)
    try:
        res = load.run_load(url, [q for q, _ in QUERIES], valid=200, idle=250, slow=50, drip_every=0.3, settle=2.0)
    finally:
        stop()
    assert res["ok"] == 200 and res["p99_s"] < 10.0, res
    assert res["idle_closed"] == 250 and res["slow_closed"] == 50, res


# --- the paper's scale: 512 prompts x 5 episodes = 2,560 queries in one search turn ----------------------------

class Counting:
    """A retriever that counts the requests (search calls) and queries that reach it."""

    def __init__(self, inner):
        self.inner, self.calls, self.sizes = inner, 0, []

    def __len__(self):
        return len(self.inner)

    def search(self, queries, topk=3):
        self.calls += 1
        self.sizes.append(len(queries))
        return self.inner.search(queries, topk)


def paper_turn(n: int = 2560) -> list[str]:
    return [f"{QUERIES[i % len(QUERIES)][0]} {i}" for i in range(n)]


def test_a_2560_query_turn_through_the_client_and_the_server(index):
    queries = paper_turn()
    want = [[p.id for p in hits] for hits in index.search(queries, topk=3)]
    counting = Counting(index)
    url, stop = start_server(counting)  # the default limits take the paper's turn in one request
    try:
        assert request(url + "/health", method="GET")[1]["limits"]["max_queries"] >= 2560
        got = HTTPRetriever(url).search(queries, topk=3)
        assert [[p.id for p in hits] for hits in got] == want and counting.sizes == [2560]
    finally:
        stop()
    counting = Counting(index)
    url, stop = start_server(counting, max_queries=300)  # a server with a smaller limit: split to it, in order
    try:
        client = HTTPRetriever(url)
        got = client.search(queries, topk=3)
        assert [[p.id for p in hits] for hits in got] == want
        assert counting.sizes == [300] * 8 + [160] and client.limits()["max_queries"] == 300
    finally:
        stop()
    counting = Counting(index)
    url, stop = start_server(counting, max_body_bytes=20_000)  # and to its body size
    try:
        got = HTTPRetriever(url).search(queries, topk=3)
        assert [[p.id for p in hits] for hits in got] == want and len(counting.sizes) > 1
        assert sum(counting.sizes) == 2560
    finally:
        stop()


def _stand_in(index, max_queries: int | None, health: bool):
    """A small stand-in for Search-R1's retrieval server (its search_r1/search/retrieval_server.py): POST
    /retrieve of {queries, topk, return_scores} answers {"result": [[{"document": {id, contents}, "score"}]]};
    it has no /health. ``max_queries``: refuse more with a 400 that states the limit (a hardened variant)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    sizes: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, status, body):
            raw = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self):
            if health and self.path == "/health":
                self._send(200, {"status": "ok"})  # a health check that states no limits
            else:
                self._send(404, {"detail": "Not Found"})  # FastAPI's answer to an unknown path

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if max_queries is not None and len(req["queries"]) > max_queries:
                self._send(400, {"error": "too many queries", "limits": {"max_queries": max_queries}})
                return
            sizes.append(len(req["queries"]))
            hits = index.search(req["queries"], req.get("topk") or 3)
            doc = lambda p: {"id": p.id, "contents": p.contents}  # noqa: E731
            self._send(200, {"result": [[{"document": doc(p), "score": p.score} if req.get("return_scores")
                                         else doc(p) for p in ps] for ps in hits]})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", sizes, server


@pytest.mark.parametrize(("max_queries", "health", "requests"), [
    (None, False, [2560]),  # Search-R1's own server: no limit, no /health: the turn in one request
    (1000, False, [1000, 1000, 560]),  # a limit stated only in a refusal: learnt, then split to
    (1000, True, [1000, 1000, 560]),  # a /health without limits, and the same refusal
])
def test_a_2560_query_turn_against_a_search_r1_style_server(index, max_queries, health, requests):
    queries = paper_turn()
    url, sizes, server = _stand_in(index, max_queries, health)
    try:
        got = HTTPRetriever(url).search(queries, topk=3)
    finally:
        server.shutdown()
        server.server_close()
    assert [[p.id for p in hits] for hits in got] == [[p.id for p in hits] for hits in index.search(queries, 3)]
    assert sizes == requests


def test_client_max_queries_long_queries_and_a_refusal_for_another_limit(server_url):
    url = server_url  # LIMITS: at most 12 queries, 200 characters
    client = HTTPRetriever(url, max_queries=5)
    assert len(client.search([q for q, _ in QUERIES] * 3, topk=1)) == 24
    assert len(client.search(["lantern", "x" * 201])) == 2  # a runaway query is cut to the stated 200 characters
    with pytest.raises(RetrieverError, match="'topk' must be an integer in"):
        client.search(["lantern"], topk=11)  # not a limit splitting can meet: the server's message, at once
    with pytest.raises(ValueError, match="max_queries"):
        HTTPRetriever(url, max_queries=0)


def test_the_observation_is_search_r1s_byte_for_byte_from_the_index_and_over_http(index, server_url):
    """Search-R1's generation.py: ``Doc {i+1}(Title: {first line of contents}) {the rest}\\n`` per passage,
    stripped, inside ``\\n\\n<information>...</information>\\n\\n``; the title keeps its quotes."""
    from emapg.tags import format_information

    paris = Passage("0", "Paris", "Paris is the capital of France.")
    assert paris.contents == '"Paris"\nParis is the capital of France.'
    assert format_information([paris]) == ('\n\n<information>Doc 1(Title: "Paris") Paris is the capital of '
                                           'France.</information>\n\n')
    untitled = Passage("1", "", "Ulvane cheese is blue.\nIt is aged in caves.")  # the first line serves as title
    assert format_information([paris, untitled]) == (
        '\n\n<information>Doc 1(Title: "Paris") Paris is the capital of France.\n'
        'Doc 2(Title: Ulvane cheese is blue.) It is aged in caves.</information>\n\n')
    queries = [q for q, _ in QUERIES] + ["the of"]
    local = index.search(queries, topk=3)
    served = HTTPRetriever(server_url).search(queries, topk=3)
    assert [format_information(p) for p in local] == [format_information(p) for p in served]
    assert format_information(local[0]).startswith('\n\n<information>Doc 1(Title: "Zorvath Kellbrook") Zorvath')
    assert format_information(local[-1]) == "\n\n<information></information>\n\n"  # no passage found
