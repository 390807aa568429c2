"""The retrieval server under load on loopback: valid requests while slow and idle connections are
held open, side by side in one run.

``idle`` connections connect and send nothing; ``slow`` ones drip a request's headers one byte at a
time. Meanwhile ``valid`` requests go out from 64 client threads at once. Reported: how many valid
requests succeeded, their latency (p50, p99, max), and how many of the slow and idle connections the
server had closed by the end (its header deadline).

    python bench/retriever_load.py
    python bench/retriever_load.py --valid 200 --idle 300 --slow 50 --header-timeout 2
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor


def _post(url: str, queries: list[str]) -> tuple[int, float]:
    data = json.dumps({"queries": queries, "topk": 2}).encode()
    req = urllib.request.Request(url + "/retrieve", data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=60) as resp:
        resp.read()
        return resp.status, time.perf_counter() - t0


def _closed(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1 << 16, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def run_load(url: str, queries: list[str], valid: int = 200, idle: int = 300, slow: int = 0,
             drip_every: float = 0.5, settle: float = 0.0) -> dict:
    """Hold ``idle`` silent and ``slow`` dripping connections, send ``valid`` requests, wait ``settle``
    seconds (the held connections still open), and report."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    held = [socket.create_connection((host, int(port))) for _ in range(idle + slow)]
    stop = threading.Event()

    def drip(sock: socket.socket) -> None:
        request = b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: 20\r\n\r\n"
        for byte in request:
            if stop.wait(drip_every):
                return
            try:
                sock.send(bytes([byte]))
            except OSError:
                return

    drippers = [threading.Thread(target=drip, args=(s,), daemon=True) for s in held[idle:]]
    for t in drippers:
        t.start()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(64) as pool:
        answers = list(pool.map(lambda i: _post(url, [queries[i % len(queries)]]), range(valid)))
    wall = time.perf_counter() - t0
    time.sleep(settle)
    closed_idle = sum(_closed(s) for s in held[:idle])
    closed_slow = sum(_closed(s) for s in held[idle:])
    stop.set()
    for s in held:
        s.close()
    lat = sorted(t for _, t in answers)
    return {"ok": sum(status == 200 for status, _ in answers), "valid": valid, "wall_s": wall,
            "p50_s": statistics.median(lat), "p99_s": lat[max(0, int(0.99 * len(lat)) - 1)], "max_s": lat[-1],
            "idle": idle, "idle_closed": closed_idle, "slow": slow, "slow_closed": closed_slow}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--valid", type=int, default=200)
    p.add_argument("--idle", type=int, default=300)
    p.add_argument("--slow", type=int, default=50)
    p.add_argument("--header-timeout", type=float, default=2.0)
    args = p.parse_args()
    import tempfile
    from pathlib import Path

    from emapg.retrieval.bm25 import BM25Index, build_index
    from emapg.retrieval.server import make_server
    from emapg.tasks.multihop_kb import make_kb

    with tempfile.TemporaryDirectory() as tmp:
        kb = make_kb(seed=0)
        corpus = Path(tmp) / "corpus.jsonl"
        corpus.write_text("".join(json.dumps(r) + "\n" for r in kb["corpus"]))
        build_index(corpus, Path(tmp) / "index")
        server = make_server(BM25Index.load(Path(tmp) / "index"), "127.0.0.1", 0, header_timeout=args.header_timeout)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        host, port = server.server_address[:2]
        url = f"http://{host}:{port}"
        time.sleep(0.5)
        queries = [r["text"][:60] for r in kb["corpus"]]
        res = run_load(url, queries, args.valid, args.idle, args.slow, settle=args.header_timeout + 1.0)
        server.shutdown()
        server.server_close()
    print(f"\n{args.valid} valid requests from 64 threads, {args.idle} idle and {args.slow} slow connections held, "
          f"header deadline {args.header_timeout:g} s\n")
    print("| valid ok | p50 s | p99 s | max s | wall s | idle closed | slow closed |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {res['ok']}/{res['valid']} | {res['p50_s']:.3f} | {res['p99_s']:.3f} | {res['max_s']:.3f} "
          f"| {res['wall_s']:.1f} | {res['idle_closed']}/{res['idle']} | {res['slow_closed']}/{res['slow']} |")


if __name__ == "__main__":
    main()
