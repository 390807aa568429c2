"""A retrieval server speaking Search-R1's HTTP API, served by uvicorn (a Starlette app).

``POST /retrieve`` with ``{"queries": [...], "topk": 3, "return_scores": true}`` answers
``{"result": [[{"document": {"id", "contents"}, "score"}, ...], ...]}`` (or ``[[{"id", "contents"}, ...]]``
without scores), one list per query. ``GET /health`` answers ``{"status": "ok", "documents": N, "limits":
{"max_queries", "max_query_chars", "max_topk", "max_body_bytes"}}``: what one request may carry, so that a
client splits a large batch to fit (:class:`emapg.retrieval.client.HTTPRetriever` does). Every error is
``{"error": message}`` with its status (a request over a limit also carries ``"limits"``): 4xx for the
client's (400, 404, 405, 408, 411, 413), 500 if the retriever itself fails, 503 when the server is at its
connection limit. The limits are flags of ``emapg serve-retriever``; the defaults take the paper's search
batch (512 prompts x 5 episodes = 2,560 queries a turn) in one request.

What a well-kept server does, uvicorn does: one event loop (an idle connection costs a socket, not
a thread), a cap on concurrent connections (``limit_concurrency``), keep-alive timeouts, bounded
header sizes. Two deadlines are ours: a request's headers must arrive within ``header_timeout``
seconds of the connection (or of the previous response) however slowly they drip, and its body
within ``body_timeout``. Binds loopback unless told otherwise (the server has no authentication).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

import h11
import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from emapg.errors import ConfigError
from emapg.retrieval import SERVER_LIMITS as DEFAULT_LIMITS
from emapg.retrieval import Retriever, open_retriever, retriever_problem

__all__ = ["RetrievalServer", "create_app", "make_server", "serve"]



class RequestError(Exception):
    """A client error: HTTP ``status`` and a message for the ``error`` field (``limit``: the error is a
    request over one of the server's limits, which the answer then states)."""

    def __init__(self, status: int, message: str, limit: bool = False):
        super().__init__(message)
        self.status = status
        self.limit = limit


def _error(status: int, message: str, headers: dict | None = None, limits: dict | None = None) -> JSONResponse:
    body: dict = {"error": message}
    if limits is not None:
        body["limits"] = limits
    return JSONResponse(body, status_code=status, headers=headers)


async def _read_body(request: Request, limit: int, timeout: float) -> bytes:
    if "chunked" in request.headers.get("transfer-encoding", "").lower():
        raise RequestError(411, "Content-Length required (chunked request bodies are not supported)")
    length = request.headers.get("content-length")
    if length is None:
        raise RequestError(411, "Content-Length required")
    try:
        n = int(length)
        if n < 0:
            raise ValueError
    except ValueError:
        raise RequestError(400, f"invalid Content-Length {length!r}") from None
    if n > limit:
        raise RequestError(413, f"request body of {n} bytes is over the limit of {limit}", limit=True)

    async def read() -> bytes:
        chunks, got = [], 0
        async for chunk in request.stream():
            got += len(chunk)
            if got > limit:
                raise RequestError(413, f"request body is over the limit of {limit} bytes", limit=True)
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), timeout)
    except TimeoutError:
        raise RequestError(408, f"the request body did not arrive within {timeout:g} s") from None


def _parse(body: bytes, max_queries: int, max_query_chars: int, max_topk: int) -> tuple[list[str], int, bool]:
    try:
        data = json.loads(body)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, or a number of more than 4,300 digits
        raise RequestError(400, f"malformed JSON body: {str(e)[:200]}") from None
    except RecursionError:
        raise RequestError(400, "malformed JSON body: nested too deeply") from None
    if not isinstance(data, dict):
        raise RequestError(400, f"the body must be a JSON object, got {type(data).__name__}")
    if "queries" not in data:
        raise RequestError(400, "missing field 'queries' (a list of strings)")
    queries = data["queries"]
    if not isinstance(queries, list):
        raise RequestError(400, f"field 'queries' must be a list of strings, got {type(queries).__name__}")
    if not queries:
        raise RequestError(400, "field 'queries' is an empty list")
    if len(queries) > max_queries:
        raise RequestError(400, f"field 'queries' has {len(queries)} queries; at most {max_queries} per request",
                           limit=True)
    for i, q in enumerate(queries):
        if not isinstance(q, str):
            raise RequestError(400, f"field 'queries': item {i} must be a string, got {type(q).__name__}")
        if len(q) > max_query_chars:
            raise RequestError(400, f"field 'queries': query {i} has {len(q)} characters; at most {max_query_chars}",
                               limit=True)
        try:  # JSON's \ud800 escapes decode to a lone surrogate, which no encoder takes (it was a 500)
            q.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RequestError(400, f"field 'queries': query {i} holds a lone surrogate (\\u{ord(q[e.start]):04x} at "
                                    f"character {e.start}), not text") from None
    topk = data.get("topk", 3)
    if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk <= max_topk:
        raise RequestError(400, f"field 'topk' must be an integer in [1, {max_topk}], got {topk!r}")
    return_scores = data.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise RequestError(400, f"field 'return_scores' must be true or false, got {return_scores!r}")
    return queries, topk, return_scores


def create_app(retriever: Retriever, *, max_queries: int = DEFAULT_LIMITS["max_queries"],
               max_query_chars: int = DEFAULT_LIMITS["max_query_chars"], max_topk: int = DEFAULT_LIMITS["max_topk"],
               max_body_bytes: int = DEFAULT_LIMITS["max_body_bytes"], body_timeout: float = 30.0,
               verbose: bool = False) -> Starlette:
    """The ASGI app of the retrieval API over ``retriever`` (searched in a worker thread)."""
    limits = {"max_queries": max_queries, "max_query_chars": max_query_chars, "max_topk": max_topk,
              "max_body_bytes": max_body_bytes}

    async def retrieve(request: Request) -> JSONResponse:
        try:
            body = await _read_body(request, max_body_bytes, body_timeout)
            queries, topk, return_scores = _parse(body, max_queries, max_query_chars, max_topk)
        except RequestError as e:
            return _error(e.status, str(e), limits=limits if e.limit else None)
        except ClientDisconnect:
            return _error(400, "the client went away mid-body")
        try:
            results = await run_in_threadpool(retriever.search, queries, topk)
        except Exception as e:
            sys.stderr.write(f"emapg retrieval: search failed: {type(e).__name__}: {e}\n")
            if verbose:
                traceback.print_exc()
            return _error(500, f"retrieval failed: {type(e).__name__}: {e}")
        if return_scores:
            result = [[{"document": {"id": p.id, "contents": p.contents}, "score": p.score} for p in ps]
                      for ps in results]
        else:
            result = [[{"id": p.id, "contents": p.contents} for p in ps] for ps in results]
        return JSONResponse({"result": result})

    async def health(request: Request) -> JSONResponse:
        payload: dict = {"status": "ok"}
        if hasattr(retriever, "__len__"):
            payload["documents"] = len(retriever)  # type: ignore[arg-type]
        return JSONResponse({**payload, "limits": limits})

    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        route = request.url.path
        messages = {404: f"unknown path {route!r}; the API is POST /retrieve and GET /health",
                    405: f"method {request.method} is not allowed on {route}; use {(exc.headers or {}).get('Allow')}"}
        return _error(exc.status_code, messages.get(exc.status_code, str(exc.detail)), headers=exc.headers)

    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        return _error(500, f"internal error: {type(exc).__name__}")

    routes = [Route(path, retrieve, methods=["POST"]) for path in ("/retrieve", "/retrieve/")]
    routes += [Route(path, health, methods=["GET"]) for path in ("/health", "/health/")]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error})


class _NamedErrors(h11.Connection):
    """h11's connection, keeping the parse error it raised (``bad Content-Length``) for the 400's message."""

    error: h11.RemoteProtocolError | None = None

    def next_event(self):
        try:
            return super().next_event()
        except h11.RemoteProtocolError as e:
            self.error = e
            raise


class _DeadlineH11(H11Protocol):
    """uvicorn's h11 protocol with a total deadline for a request's headers, counted from the connection
    (or from the end of the previous response) whatever the client sends meanwhile: uvicorn's own
    keep-alive timer restarts on every byte, so a client dripping one byte every few seconds would hold
    its connection for ever. Malformed requests get the JSON error form too."""

    header_timeout = 10.0
    _deadline: asyncio.TimerHandle | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.conn = _NamedErrors(h11.SERVER, self.config.h11_max_incomplete_event_size or 16 * 1024)  # uvicorn's

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.header_timeout, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
            self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm()  # the headers are in: the app's body deadline takes over

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        error = getattr(self.conn, "error", None)
        if error is not None and str(error):  # what was wrong, not only that something was
            msg = f"invalid HTTP request: {error}"
        body = json.dumps({"error": msg}).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode())]
        self.conn = h11.Connection(h11.SERVER)  # the failed parse left the old one in an error state
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            try:
                self.transport.write(self.conn.send(event))
            except h11.LocalProtocolError:
                break
        self.transport.close()


class RetrievalServer:
    """uvicorn serving :func:`create_app` on a socket bound at construction (``port=0``: any free one;
    see ``server_address``). ``serve_forever()`` blocks until ``shutdown()`` (or Ctrl-C)."""

    def __init__(self, address: tuple[str, int], app: Starlette, *, limit_concurrency: int = 1024,
                 header_timeout: float = 10.0, keep_alive: float = 5.0, backlog: int = 2048, verbose: bool = False):
        host, port = address
        self.socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((host, port))
        except OSError:
            self.socket.close()
            raise
        self.socket.listen(backlog)
        self.server_address = self.socket.getsockname()
        protocol = type("DeadlineH11", (_DeadlineH11,), {"header_timeout": header_timeout})
        config = uvicorn.Config(app, http=protocol, lifespan="off", limit_concurrency=limit_concurrency,
                                timeout_keep_alive=keep_alive, backlog=backlog, access_log=verbose,
                                log_level="info" if verbose else "warning", ws="none")
        self.server = uvicorn.Server(config)
        self._done = threading.Event()

    def serve_forever(self, poll_interval: float | None = None) -> None:
        try:
            self.server.run(sockets=[self.socket])
        finally:
            self._done.set()

    def shutdown(self) -> None:
        self.server.should_exit = True
        self._done.wait(10)

    def server_close(self) -> None:
        self.socket.close()


def make_server(retriever: Retriever, host: str = "127.0.0.1", port: int = 0, *, body_timeout: float = 30.0,
                header_timeout: float = 10.0, limit_concurrency: int = 1024, verbose: bool = False,
                **limits: int) -> RetrievalServer:
    """A bound (not yet serving) retrieval server; ``port=0`` takes any free port (see ``server_address``).
    ``limits``: any of :data:`DEFAULT_LIMITS` (what one request may carry)."""
    check_limits(limits)
    app = create_app(retriever, body_timeout=body_timeout, verbose=verbose, **{**DEFAULT_LIMITS, **limits})
    return RetrievalServer((host, port), app, limit_concurrency=limit_concurrency, header_timeout=header_timeout,
                           verbose=verbose)


def check_limits(limits: dict) -> None:
    """Refuse an unknown limit or one below 1, naming its command-line flag."""
    unknown = set(limits) - set(DEFAULT_LIMITS)
    if unknown:
        raise TypeError(f"unknown retrieval server limit(s) {', '.join(sorted(unknown))}")
    for name, value in limits.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"--{name.replace('_', '-')}: must be an integer >= 1, got {value!r}")


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


OPTIONS = {"search_params": "--search-param", "retriever": "--retriever", "device": "--device"}


def _as_option(problem: str) -> ConfigError:
    """A retriever setting's problem (``field: why``) named as the command's option."""
    field, _, why = problem.partition(": ")
    return ConfigError(f"{OPTIONS[field]}: {why}")


def serve(index_dir: str | Path, host: str = "127.0.0.1", port: int = 8000, *, verbose: bool = False,
          allow_remote: bool = False, retriever: str = "bm25", search_params: dict | None = None,
          device: str = "cpu", **limits: int) -> None:
    """Serve an index folder until interrupted (Ctrl-C) as ``retriever`` (bm25, dense or hybrid; see
    ``emapg.retrieval.open_retriever``, which also takes ``search_params`` and ``device``); loopback only unless
    ``allow_remote``."""
    check_address(host, port, allow_remote)
    check_limits(limits)
    problem = retriever_problem(retriever, str(index_dir), None, search_params, device)
    if problem:
        raise _as_option(problem)
    try:
        index = open_retriever(index=str(index_dir), kind=retriever, search_params=search_params, device=device)
    except ValueError as e:  # a device this machine has not (found when the embedder loads)
        if not str(e).startswith("device: "):
            raise
        raise _as_option(str(e)) from None
    where = getattr(index, "devices", None)
    if where:
        print(f"emapg retrieval: {where}", file=sys.stderr, flush=True)
    try:
        server = make_server(index, host, port, verbose=verbose, **limits)
    except OSError as e:
        raise ConfigError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None
    try:
        h, p = server.server_address[:2]
        shown = f"[{h}]" if ":" in h else h
        print(f"emapg retrieval: serving {len(index)} documents ({retriever}) from {index_dir} at http://{shown}:{p}/retrieve",
              file=sys.stderr, flush=True)
        if not _is_loopback(host):
            print(f"emapg retrieval: warning: --allow-remote: bound to {host}, reachable from the network "
                  "(no authentication)", file=sys.stderr, flush=True)
        started = time.monotonic()
        server.serve_forever()
        if verbose:
            print(f"emapg retrieval: stopped after {time.monotonic() - started:.0f} s", file=sys.stderr)
    finally:
        server.server_close()
