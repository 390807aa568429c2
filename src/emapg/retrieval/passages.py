"""The passages of an index folder, shared by every retriever built in it (BM25, dense).

``read_corpus`` validates a ``{id, title?, text}`` corpus (errors name the file, the line and the field, or
the two lines of a duplicate id); ``write_passages`` / ``read_passages`` keep the passages in index order
as ``passages.jsonl``, the one copy of the text that BM25 and the dense index both point into by row.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from emapg.data import DataError, check_text, iter_rows
from emapg.errors import regular_file
from emapg.retrieval.client import parse_contents

PASSAGES_FILE = "passages.jsonl"
DENSE_DIR, DENSE_META = "dense", "dense.json"
"""Where ``emapg.retrieval.dense`` keeps its index inside an index folder, and its metadata file."""


def has_dense(folder: Path) -> bool:
    """Whether an index folder holds a finished dense index (its metadata is written last)."""
    return (Path(folder) / DENSE_DIR / DENSE_META).is_file()


def read_meta(path: Path) -> dict:
    """An index's metadata file (``emapg_index.json``, ``dense/dense.json``); a damaged one is a ValueError
    naming it and the rebuild, not a bare JSON error."""
    try:
        meta = json.loads(Path(path).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: damaged, not the JSON an index build writes ({e}); rebuild the index") from None
    if not isinstance(meta, dict):
        raise DataError(f"{path}: damaged, expected a JSON object; rebuild the index")
    return meta


@dataclass
class Passages:
    """Passages in index order: row i is ``ids[i]``, ``titles[i]``, ``texts[i]``; ``sha256``: the digest of
    the ``passages.jsonl`` they were read from (None when not read from one)."""

    ids: list[str]
    titles: list[str]
    texts: list[str]
    sha256: str | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def contents(self, i: int) -> str:
        """Row i as Search-R1 writes a passage: ``"Title"`` on the first line, then the text."""
        return f'"{self.titles[i]}"\n{self.texts[i]}' if self.titles[i] else self.texts[i]


def _field(corpus: Path, pid: str, row: dict, name: str) -> str:
    value = row.get(name)
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    raise DataError(f"{corpus}: passage id {pid!r}: field {name!r} must be a string, got {type(value).__name__}")


def _passage(corpus: Path, row: dict, fields: dict[str, str]) -> tuple[str, str, str]:
    """One corpus row as ``(id, title, text)``: ``{id, title?, text}`` or Search-R1's ``{id, contents}``
    (columns renamed by ``fields``), every problem naming the file, the line and the field."""
    where = row.pop("_where")
    for name, column in fields.items():
        if column not in row:
            raise DataError(f"{corpus}, {where}: missing field {column!r} (mapped to {name!r}); the row has "
                            f"{', '.join(sorted(row))}")
    row = {**row, **{name: row[column] for name, column in fields.items()}}
    row.setdefault("id", where.replace(" ", "-"))  # a corpus without ids: its line numbers
    if "text" not in row and isinstance(row.get("contents"), str):  # Search-R1's layout
        row["title"], row["text"] = parse_contents(row["contents"])
    for name in ("id", "text"):
        if row.get(name) is None:
            raise DataError(f"{corpus}, {where}: missing field {name!r} (a passage is {{id, title, text}} or "
                            f"{{id, contents}}); the row has {', '.join(sorted(row))}")
    pid = str(row["id"])
    title, text = _field(corpus, pid, row, "title"), _field(corpus, pid, row, "text")
    check_text([pid, title, text], f"{corpus}, {where}")
    return pid, title, text


def iter_corpus(corpus: str | Path, fields: dict[str, str] | None = None) -> Iterator[tuple[str, str, str]]:
    """A corpus's passages ``(id, title, text)`` in file order, one at a time (JSONL and Parquet streamed:
    what a 21M-passage Wikipedia needs); ids are not checked for duplicates here."""
    corpus = Path(corpus)
    for where, row in iter_rows(corpus):
        yield _passage(corpus, {**row, "_where": where}, fields or {})


def read_corpus(corpus: str | Path, fields: dict[str, str] | None = None) -> Passages:
    """The passages of a JSONL/JSON/Parquet corpus (``fields`` renames columns as in ``emapg.data.load_rows``):
    ``{id, title?, text}`` rows, or Search-R1's ``{id, contents}`` (wiki-18.jsonl: ``"Title"`` on the first
    line of ``contents``, then the text), split so that a passage's contents are the row's, byte for byte.
    Raises DataError for a malformed row or a duplicate id."""
    corpus = Path(corpus)
    out = Passages([], [], [])
    seen: dict[str, int] = {}
    for i, (pid, title, text) in enumerate(iter_corpus(corpus, fields)):
        if pid in seen:
            raise DataError(f"{corpus}: duplicate id {pid!r} (passages {seen[pid] + 1} and {i + 1})")
        seen[pid] = i
        out.ids.append(pid)
        out.titles.append(title)
        out.texts.append(text)
    if not out.ids:
        raise DataError(f"{corpus}: no rows (the file is empty)")
    return out


def _id_key(pid: str) -> int:
    return int.from_bytes(hashlib.blake2b(pid.encode("utf-8"), digest_size=8).digest(), "little")


def stream_passages(corpus: str | Path, out: Path, fields: dict[str, str] | None = None) -> tuple[int, str]:
    """Write a corpus's passages to the file ``out`` as they are read (the ``passages.jsonl`` ``write_passages``
    writes, byte for byte), never holding the corpus: memory is 8 bytes a passage (a hash of its id, for the
    duplicate check). Returns the number of passages and the file's sha256. Raises DataError for a malformed
    row or a duplicate id (naming both passages)."""
    corpus = Path(corpus)
    keys, h, count = array("Q"), hashlib.sha256(), 0
    with open(out, "wb") as f:
        for pid, title, text in iter_corpus(corpus, fields):
            line = passage_line(pid, title, text)
            f.write(line)
            h.update(line)
            keys.append(_id_key(pid))
            count += 1
    if not count:
        raise DataError(f"{corpus}: no rows (the file is empty)")
    _check_unique(corpus, keys, out)
    return count, h.hexdigest()


def _check_unique(corpus: Path, keys: array, written: Path) -> None:
    """Duplicate ids among the hashed ones: a repeated hash is confirmed on the written file (so a hash
    collision is no error) and named by the two passages' numbers."""
    order = np.argsort(np.frombuffer(keys, dtype=np.uint64), kind="stable")
    ranked = np.frombuffer(keys, dtype=np.uint64)[order]
    for at in np.flatnonzero(ranked[1:] == ranked[:-1]):
        first, second = sorted((int(order[at]), int(order[at + 1])))
        ids = _ids_at(written, {first, second})
        if ids[first] == ids[second]:
            raise DataError(f"{corpus}: duplicate id {ids[first]!r} (passages {first + 1} and {second + 1})")


def _ids_at(path: Path, rows: set[int]) -> dict[int, str]:
    out = {}
    with open(path, "rb") as f:
        for i, line in enumerate(f):
            if i in rows:
                out[i] = json.loads(line)["id"]
    return out


def passage_line(pid: str, title: str, text: str) -> bytes:
    """One passage as ``passages.jsonl`` holds it: the bytes both writers write and the digest covers."""
    return (json.dumps({"id": pid, "title": title, "text": text}, ensure_ascii=False) + "\n").encode("utf-8")


def write_passages(passages: Passages, folder: Path) -> None:
    with open(folder / PASSAGES_FILE, "wb") as f:
        for pid, title, text in zip(passages.ids, passages.titles, passages.texts, strict=True):
            f.write(passage_line(pid, title, text))


def read_passages(folder: Path) -> Passages:
    """The folder's passages, hashed as they are read (one pass over the file gives both)."""
    out, h = Passages([], [], []), hashlib.sha256()
    file = folder / PASSAGES_FILE
    regular_file(file, "index")
    with open(file, "rb") as f:
        for i, line in enumerate(f, 1):
            h.update(line)
            try:
                p = json.loads(line)
                out.ids.append(p["id"])
                out.titles.append(p["title"])
                out.texts.append(p["text"])
            except (ValueError, KeyError, TypeError) as e:  # an index this version did not write whole
                raise DataError(f"{file}, line {i}: damaged ({type(e).__name__}: {e}); build the index again "
                                "(emapg index build)") from None
    out.sha256 = h.hexdigest()
    return out


def passages_digest(folder: Path) -> str:
    """sha256 of ``passages.jsonl``: what a dense index was encoded from (a rebuilt corpus invalidates it)."""
    return passages_count_digest(folder)[1]


def passages_count_digest(folder: Path) -> tuple[int, str]:
    """The number of passages in ``passages.jsonl`` and its sha256, in one pass that holds no text."""
    h, lines = hashlib.sha256(), 0
    with open(folder / PASSAGES_FILE, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            lines += block.count(b"\n")
    return lines, h.hexdigest()
