"""The passages of an index folder, shared by every retriever built in it (BM25, dense).

``read_corpus`` validates a ``{id, title?, text}`` corpus (errors name the file, the line and the field, or
the two lines of a duplicate id); ``write_passages`` / ``read_passages`` keep the passages in index order
as ``passages.jsonl``, the one copy of the text that BM25 and the dense index both point into by row.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from emapg.data import DataError, load_rows

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
        raise ValueError(f"{path}: damaged, not the JSON an index build writes ({e}); rebuild the index") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: damaged, expected a JSON object; rebuild the index")
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


def read_corpus(corpus: str | Path, fields: dict[str, str] | None = None) -> Passages:
    """The passages of a JSONL/JSON/Parquet corpus (``fields`` renames columns as in ``emapg.data.load_rows``):
    ``{id, title?, text}`` rows, or Search-R1's ``{id, contents}`` (wiki-18.jsonl: ``"Title"`` on the first
    line of ``contents``, then the text), split so that a passage's contents are the row's, byte for byte.
    Raises DataError for a malformed row or a duplicate id."""
    from emapg.retrieval.client import parse_contents

    corpus = Path(corpus)
    rows = load_rows(corpus, fields)
    for row in rows:
        if "text" not in row and isinstance(row.get("contents"), str):  # Search-R1's layout
            row["title"], row["text"] = parse_contents(row["contents"])
        for name in ("id", "text"):
            if row.get(name) is None:
                raise DataError(f"{row['_source']}: missing field {name!r} (a passage is {{id, title, text}} or "
                                f"{{id, contents}}); the row has {', '.join(sorted(k for k in row if k[0] != '_'))}")
    out = Passages([], [], [])
    seen: dict[str, int] = {}
    for i, row in enumerate(rows):
        pid = str(row["id"])
        if pid in seen:
            raise DataError(f"{corpus}: duplicate id {pid!r} (passages {seen[pid] + 1} and {i + 1})")
        seen[pid] = i
        out.ids.append(pid)
        out.titles.append(_field(corpus, pid, row, "title"))
        out.texts.append(_field(corpus, pid, row, "text"))
    return out


def write_passages(passages: Passages, folder: Path) -> None:
    with open(folder / PASSAGES_FILE, "w", encoding="utf-8") as f:
        for pid, title, text in zip(passages.ids, passages.titles, passages.texts, strict=True):
            f.write(json.dumps({"id": pid, "title": title, "text": text}, ensure_ascii=False) + "\n")


def read_passages(folder: Path) -> Passages:
    """The folder's passages, hashed as they are read (one pass over the file gives both)."""
    out, h = Passages([], [], []), hashlib.sha256()
    with open(folder / PASSAGES_FILE, "rb") as f:
        for line in f:
            h.update(line)
            p = json.loads(line)
            out.ids.append(p["id"])
            out.titles.append(p["title"])
            out.texts.append(p["text"])
    out.sha256 = h.hexdigest()
    return out


def passages_digest(folder: Path) -> str:
    """sha256 of ``passages.jsonl``: what a dense index was encoded from (a rebuilt corpus invalidates it)."""
    h = hashlib.sha256()
    with open(folder / PASSAGES_FILE, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
