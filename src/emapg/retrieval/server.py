"""A retrieval server speaking Search-R1's HTTP API (stdlib only).

``POST /retrieve`` with ``{"queries": [...], "topk": 3, "return_scores": true}`` answers
``{"result": [[{"document": {"id", "contents"}, "score"}, ...], ...]}`` (or ``[[{"id", "contents"}, ...]]``
without scores), one list per query. ``GET /health`` answers ``{"status": "ok", "documents": N}``.
Errors are ``{"error": message}`` with a 4xx status (5xx if the retriever itself fails).
"""

from __future__ import annotations

import ipaddress
import json
import socket
import sys
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

from emapg.config import ConfigError
from emapg.retrieval import Retriever

__all__ = ["RetrievalServer", "make_server", "serve"]


class RequestError(Exception):
    """A client error: HTTP ``status`` and a message for the ``error`` field."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class RetrievalServer(ThreadingHTTPServer):
    """A threaded HTTP server holding the retriever and the request limits."""

    daemon_threads = True
    request_queue_size = 512

    def __init__(self, address: tuple[str, int], retriever: Retriever, *, max_queries: int, max_query_chars: int,
                 max_topk: int, max_body_bytes: int, verbose: bool = False):
        self.retriever = retriever
        self.max_queries = max_queries
        self.max_query_chars = max_query_chars
        self.max_topk = max_topk
        self.max_body_bytes = max_body_bytes
        self.verbose = verbose
        super().__init__(address, _Handler)


class _RetrievalServer6(RetrievalServer):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    server: RetrievalServer
    server_version = "emapg-retrieval/1"
    protocol_version = "HTTP/1.1"  # keep-alive for clients that reuse connections
    timeout = 60  # seconds an idle kept-alive connection holds its thread

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base class's name)
        if self.server.verbose:
            super().log_message(format, *args)

    def _send(self, status: int, payload: dict, close: bool = False, headers: dict | None = None) -> None:
        body = json.dumps(payload, ensure_ascii=False).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)
        if close:
            self._linger()

    def _linger(self, seconds: float = 2.0, limit: int = 16 << 20) -> None:
        """Discard what the client still sends (bounded) so closing does not reset the connection
        before the client has read the error response."""
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            deadline, got = time.monotonic() + seconds, 0
            while got < limit and (left := deadline - time.monotonic()) > 0:
                self.connection.settimeout(left)
                chunk = self.connection.recv(1 << 16)
                if not chunk:
                    break
                got += len(chunk)
        except OSError:
            pass

    def _route(self) -> str:
        path = urlsplit(self.path).path
        return path.rstrip("/") or "/"

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        route = self._route()
        if route == "/health":
            payload: dict = {"status": "ok"}
            if hasattr(self.server.retriever, "__len__"):
                payload["documents"] = len(self.server.retriever)  # type: ignore[arg-type]
            self._send(200, payload)
        elif route == "/retrieve":
            self._send(405, {"error": "use POST for /retrieve"}, headers={"Allow": "POST"})
        else:
            self._send(404, {"error": f"unknown path {route!r}; the API is POST /retrieve and GET /health"})

    def do_POST(self) -> None:  # noqa: N802
        route = self._route()
        if route != "/retrieve":
            # the body is not read: close the connection rather than parse it as the next request
            if route == "/health":
                self._send(405, {"error": "use GET for /health"}, close=True, headers={"Allow": "GET"})
            else:
                self._send(404, {"error": f"unknown path {route!r}; the API is POST /retrieve and GET /health"},
                           close=True)
            return
        try:
            body = self._read_body()
        except RequestError as e:
            self._send(e.status, {"error": str(e)}, close=True)
            return
        if body is None:  # the client went away mid-body
            self.close_connection = True
            return
        try:
            queries, topk, return_scores = self._parse(body)
        except RequestError as e:
            self._send(e.status, {"error": str(e)})
            return
        try:
            results = self.server.retriever.search(queries, topk=topk)
        except Exception as e:
            sys.stderr.write(f"emapg retrieval: search failed: {type(e).__name__}: {e}\n")
            if self.server.verbose:
                traceback.print_exc()
            self._send(500, {"error": f"retrieval failed: {type(e).__name__}: {e}"})
            return
        if return_scores:
            result = [[{"document": {"id": p.id, "contents": p.contents}, "score": p.score} for p in ps]
                      for ps in results]
        else:
            result = [[{"id": p.id, "contents": p.contents} for p in ps] for ps in results]
        self._send(200, {"result": result})

    def _read_body(self) -> bytes | None:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raise RequestError(411, "Content-Length required (chunked request bodies are not supported)")
        length = self.headers.get("Content-Length")
        if length is None:
            raise RequestError(411, "Content-Length required")
        try:
            n = int(length)
            if n < 0:
                raise ValueError
        except ValueError:
            raise RequestError(400, f"invalid Content-Length {length!r}") from None
        if n > self.server.max_body_bytes:
            raise RequestError(413, f"request body of {n} bytes is over the limit of {self.server.max_body_bytes}")
        body = self.rfile.read(n)
        return body if len(body) == n else None

    def _parse(self, body: bytes) -> tuple[list[str], int, bool]:
        s = self.server
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(400, f"malformed JSON body: {e}") from None
        if not isinstance(data, dict):
            raise RequestError(400, f"the body must be a JSON object, got {type(data).__name__}")
        if "queries" not in data:
            raise RequestError(400, "missing field 'queries' (a list of strings)")
        queries = data["queries"]
        if not isinstance(queries, list):
            raise RequestError(400, f"field 'queries' must be a list of strings, got {type(queries).__name__}")
        if not queries:
            raise RequestError(400, "field 'queries' is an empty list")
        if len(queries) > s.max_queries:
            raise RequestError(400, f"field 'queries' has {len(queries)} queries; at most {s.max_queries} per request")
        for i, q in enumerate(queries):
            if not isinstance(q, str):
                raise RequestError(400, f"field 'queries': item {i} must be a string, got {type(q).__name__}")
            if len(q) > s.max_query_chars:
                raise RequestError(400, f"field 'queries': query {i} has {len(q)} characters; "
                                        f"at most {s.max_query_chars}")
        topk = data.get("topk", 3)
        if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk <= s.max_topk:
            raise RequestError(400, f"field 'topk' must be an integer in [1, {s.max_topk}], got {topk!r}")
        return_scores = data.get("return_scores", False)
        if not isinstance(return_scores, bool):
            raise RequestError(400, f"field 'return_scores' must be true or false, got {return_scores!r}")
        return queries, topk, return_scores


def make_server(retriever: Retriever, host: str = "127.0.0.1", port: int = 0, *, max_queries: int = 256,
                max_query_chars: int = 2048, max_topk: int = 50, max_body_bytes: int = 1 << 20,
                verbose: bool = False) -> RetrievalServer:
    """A bound (not yet serving) retrieval server; ``port=0`` takes any free port (see ``server_address``)."""
    cls = _RetrievalServer6 if ":" in host else RetrievalServer
    return cls((host, port), retriever, max_queries=max_queries, max_query_chars=max_query_chars, max_topk=max_topk,
               max_body_bytes=max_body_bytes, verbose=verbose)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_address(host: str, port: int, allow_remote: bool) -> None:
    """Refuse, with a message naming the option, a host that is not an address, a port out of range, or
    (unless ``allow_remote``) an address reachable from the network: the server has no authentication."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port}: expected 0..65535")
    if host != "localhost":
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ConfigError(f"--host {host!r}: expected an IP address (127.0.0.1, ::1, 0.0.0.0) or localhost") \
                from None
    if not _is_loopback(host) and not allow_remote:
        raise ConfigError(f"--host {host}: reachable from the network, and the retriever has no authentication; "
                          "pass --allow-remote to serve it there anyway")


def serve(index_dir: str | Path, host: str = "127.0.0.1", port: int = 8000, *, verbose: bool = False,
          allow_remote: bool = False) -> None:
    """Serve a BM25 index folder until interrupted (Ctrl-C); loopback only unless ``allow_remote``."""
    from emapg.retrieval.bm25 import BM25Index

    check_address(host, port, allow_remote)
    index = BM25Index.load(index_dir)
    try:
        server = make_server(index, host, port, verbose=verbose)
    except OSError as e:
        raise ConfigError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None
    try:
        h, p = server.server_address[:2]
        shown = f"[{h}]" if ":" in h else h
        print(f"emapg retrieval: serving {len(index)} documents from {index_dir} at http://{shown}:{p}/retrieve",
              file=sys.stderr, flush=True)
        if not _is_loopback(host):
            print(f"emapg retrieval: warning: --allow-remote: bound to {host}, reachable from the network "
                  "(no authentication)", file=sys.stderr, flush=True)
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
