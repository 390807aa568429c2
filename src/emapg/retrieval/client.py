"""A client for retrieval servers speaking Search-R1's ``POST /retrieve`` API."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

from emapg.errors import ConfigError
from emapg.retrieval import Passage, RetrieverError

__all__ = ["HTTPRetriever", "parse_contents"]


def parse_contents(contents: str) -> tuple[str, str]:
    """Split Search-R1 ``contents`` (``"Title"`` on the first line, then the text) into ``(title, text)``."""
    first, sep, rest = contents.partition("\n")
    if len(first) >= 2 and first.startswith('"') and first.endswith('"'):
        return first[1:-1], rest
    return "", contents


class HTTPRetriever:
    """Queries a retrieval server at ``url`` (``http://host:port`` or ``http://host:port/retrieve``).

    A batch larger than one request may carry is split: the limits come from the server's ``GET /health``
    (emapg's server states them), or from a refusal that states them; a server that states none (Search-R1's
    own) gets the whole batch in one request, as Search-R1 sends it. A query longer than the stated
    ``max_query_chars`` is cut to it (a model's runaway query must not stop a training run). ``max_queries``
    caps a request further on the client's side. Connection errors, timeouts and 5xx answers are retried
    ``retries`` times with a short exponential backoff; any other 4xx answer raises RetrieverError at once
    with the server's message.
    """

    def __init__(self, url: str, timeout: float = 30.0, retries: int = 3, backoff: float = 0.5,
                 max_queries: int | None = None):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"retrieval server url must be http://host:port[/retrieve], got {url!r}")
        if retries < 0:
            raise ConfigError(f"retries must be >= 0, got {retries}")
        base = url.rstrip("/")
        self.url = base if base.endswith("/retrieve") else base + "/retrieve"
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        if max_queries is not None and max_queries < 1:
            raise ConfigError(f"max_queries must be >= 1, got {max_queries}")
        self.max_queries = max_queries
        self._limits: dict | None = None  # the server's, read once from /health

    def limits(self) -> dict:
        """What one request may carry, as the server states it in ``GET /health`` (``{}`` when it states
        nothing, e.g. Search-R1's server, which has no /health); asked once."""
        if self._limits is None:
            health = self.url.removesuffix("/retrieve") + "/health"
            try:
                with urllib.request.urlopen(health, timeout=self.timeout) as resp:
                    stated = json.loads(_read_by(resp, time.monotonic() + self.timeout)).get("limits")
            except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError, AttributeError):
                stated = None
            self._limits = _valid_limits(stated)
        return self._limits

    def __repr__(self) -> str:
        return f"HTTPRetriever({self.url!r})"

    def _post(self, payload: dict) -> dict:
        body = _encode(payload)
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(self.backoff * 2 ** (attempt - 1), 8.0))
            req = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
            try:
                deadline = time.monotonic() + self.timeout
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    raw = _read_by(resp, deadline)
            except urllib.error.HTTPError as e:
                message, stated = _error_message(e)
                if stated and stated != self._limits and e.code in (400, 413):
                    self._limits = stated  # a refusal that states the limits: split to them and send again
                    raise _OverLimit from None
                if 400 <= e.code < 500:
                    raise RetrieverError(f"retrieval server {self.url} rejected the request "
                                         f"(HTTP {e.code}): {message}") from None
                last = f"HTTP {e.code}: {message}"
                continue
            except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
                reason = e.reason if isinstance(e, urllib.error.URLError) else e
                last = f"{type(reason).__name__}: {reason}" if str(reason) else type(reason).__name__
                continue
            try:
                data = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise RetrieverError(f"retrieval server {self.url} answered malformed JSON: {e}") from None
            if not isinstance(data, dict):
                raise RetrieverError(f"retrieval server {self.url} answered {type(data).__name__}, not an object")
            return data
        raise RetrieverError(f"retrieval server {self.url} failed after {self.retries + 1} attempts: {last}")

    def search(self, queries: list[str], topk: int = 3) -> list[list[Passage]]:
        """The ``topk`` best passages for each query, best first, as ranked by the server."""
        if isinstance(queries, str):
            raise TypeError("search takes a list of queries, not a single string")
        queries = list(queries)
        if not queries:
            return []
        if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1:
            raise ValueError(f"topk must be an integer >= 1, got {topk!r}")
        for _ in range(3):  # the limits may be learnt from a refusal once; a server that changes them, twice
            try:
                return [hits for part in self._parts(queries, topk) for hits in self._search_part(part, topk)]
            except _OverLimit:
                continue
        raise RetrieverError(f"retrieval server {self.url} refused requests split to the limits it states "
                             f"({self._limits})")

    def _parts(self, queries: list[str], topk: int) -> list[list[str]]:
        """``queries`` cut into consecutive requests within the server's limits (and ``max_queries``)."""
        limits = self.limits()
        most = min(x for x in (limits.get("max_queries"), self.max_queries, len(queries)) if x)
        if limits.get("max_query_chars"):
            queries = [q[: limits["max_query_chars"]] for q in queries]
        budget = limits.get("max_body_bytes")
        parts: list[list[str]] = [[]]
        size = empty = len(_encode({"queries": [], "topk": topk, "return_scores": True}))
        for q in queries:
            cost = len(_encode(q)) + 2  # the string and its separator
            if parts[-1] and (len(parts[-1]) >= most or (budget and size + cost > budget)):
                parts.append([])
                size = empty
            parts[-1].append(q)
            size += cost
        return parts

    def _search_part(self, queries: list[str], topk: int) -> list[list[Passage]]:
        data = self._post({"queries": queries, "topk": topk, "return_scores": True})
        result = data.get("result")
        if not isinstance(result, list) or len(result) != len(queries):
            raise RetrieverError(f"retrieval server {self.url} answered without a 'result' list of "
                                 f"{len(queries)} entries: {str(data)[:200]}")
        try:
            return [[_passage(item) for item in hits] for hits in result]
        except (TypeError, KeyError, ValueError, AttributeError) as e:
            raise RetrieverError(f"retrieval server {self.url} answered a malformed result: "
                                 f"{type(e).__name__}: {e}") from None


class _OverLimit(Exception):
    """A request was refused for a limit the refusal states: split again and resend."""


def _encode(value) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode("utf-8")


def _valid_limits(stated) -> dict:
    """The positive integer limits a server stated, by name; anything else is ignored."""
    if not isinstance(stated, dict):
        return {}
    return {k: v for k, v in stated.items() if k in ("max_queries", "max_query_chars", "max_body_bytes")
            and isinstance(v, int) and not isinstance(v, bool) and v >= 1}


def _passage(item: dict) -> Passage:
    """A Passage from ``{"document": {...}, "score": s}`` or a bare ``{"id", "contents"}`` document."""
    doc, score = (item["document"], float(item.get("score", 0.0))) if "document" in item else (item, 0.0)
    if "contents" in doc:
        title, text = parse_contents(doc["contents"])
    else:  # servers that keep title and text apart
        title, text = doc.get("title", ""), doc["text"]
    return Passage(str(doc.get("id", "")), title, text, score)


def _error_message(e: urllib.error.HTTPError) -> tuple[str, dict]:
    """The server's message of an HTTP error, and the limits it states ({} if none)."""
    try:
        raw = e.read()
    except OSError:
        return e.reason or "", {}
    try:
        data = json.loads(raw)
        if isinstance(data, dict) and "error" in data:
            return str(data["error"]), _valid_limits(data.get("limits"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        pass
    return raw.decode("utf-8", "replace")[:500] or str(e.reason), {}


def _read_by(resp, deadline: float) -> bytes:
    """An answer's body, read in pieces until ``deadline`` (time.monotonic()): a socket timeout bounds each read
    only, so a server that drips its answer a byte at a time would otherwise hold a run for ever. Past the
    deadline a TimeoutError (retried as a timeout)."""
    chunks = []
    while chunk := resp.read1(1 << 16):
        chunks.append(chunk)
        if time.monotonic() > deadline:
            raise TimeoutError("the answer took longer than the timeout to arrive")
    return b"".join(chunks)
