"""Loading prompt datasets: JSONL, JSON, Parquet files and `datasets` folders saved to disk.

``load_rows(path, fields)`` returns a list of dicts with the fields renamed to what a task
expects (``{"problem": "question"}`` maps the file's ``question`` column to ``problem``), each
with ``_source`` ("FILE, line N") for messages about it. Every
error names the file, the line (for JSONL) and the field.
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from emapg.errors import EmapgError, not_utf8, regular_file

SHIPPED = Path(__file__).resolve().parent / "data_files"  # data the recipes need, named emapg:NAME


class DataError(EmapgError, ValueError):
    """A problem in a user's data file."""


def shipped_names() -> list[str]:
    return sorted(p.name.removesuffix(".jsonl.gz") for p in SHIPPED.glob("*.jsonl.gz"))


def resolve(path: str | Path) -> Path:
    """A data path: ``emapg:NAME`` is a file shipped with the package (``data_files/README.md``), any
    other path is the user's file."""
    text = str(path)
    if not text.startswith("emapg:"):
        return Path(path)
    name = text.removeprefix("emapg:")
    if name not in shipped_names():
        raise DataError(f"data file {text}: emapg ships no {name!r}; it ships {', '.join(shipped_names())}")
    return SHIPPED / f"{name}.jsonl.gz"


def _iter_jsonl(path: Path) -> Iterator[tuple[str, dict]]:
    """The rows of a JSONL file one at a time (a damaged .gz is a DataError naming it)."""
    try:
        yield from _jsonl_rows(path)
    except (OSError, EOFError, zlib.error) as e:  # a damaged .gz: gzip raises while it reads
        if path.suffix != ".gz":
            raise
        raise DataError(f"{path}: not a readable gzip file ({type(e).__name__}: {e})") from None


def _jsonl_rows(path: Path) -> Iterator[tuple[str, dict]]:
    with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
        for i, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}, line {i}: not UTF-8 text (byte {raw[e.start]:#04x} at column "
                                f"{e.start + 1})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}, line {i}: malformed JSON ({e.msg} at column {e.colno})") from None
            except RecursionError:  # JSON nested some 100,000 deep: Python's parser recurses once a level
                raise DataError(f"{path}, line {i}: JSON nested too deeply to read (no row of a data set is)") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}, line {i}: expected a JSON object, got {type(row).__name__}")
            yield f"line {i}", row


def _iter_parquet(path: Path, batch_rows: int = 4096) -> Iterator[tuple[str, dict]]:
    """A Parquet file's rows a batch at a time (pyarrow), never the whole table in memory."""
    import pyarrow.parquet as pq  # (optional: emapg[math], for Parquet files)

    try:
        reader = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's own error types for a file that is not Parquet
        raise DataError(f"{path}: not a readable Parquet file ({type(e).__name__}: {str(e)[:200]})") from None
    i = 0
    for batch in reader.iter_batches(batch_size=batch_rows):
        for row in batch.to_pylist():
            yield f"row {i}", row
            i += 1


def iter_rows(path: str | Path) -> Iterator[tuple[str, dict]]:
    """A data file's raw rows, ``(where, row)``, one at a time: JSONL (plain or .gz) and Parquet are streamed
    (memory flat in the file's size); a JSON list and a ``datasets`` folder are read whole first."""
    path = resolve(path)
    if not path.exists():
        raise DataError(f"data file {path} does not exist")
    if path.is_dir():
        return iter(_read_table(path))
    regular_file(path, "data file")  # a FIFO or a device would be read for ever
    if path.suffix == ".jsonl" or path.name.endswith(".jsonl.gz"):
        return _iter_jsonl(path)
    if path.suffix == ".json":
        return iter(_read_json(path))
    if path.suffix == ".parquet":
        return _iter_parquet(path)
    raise DataError(f"{path}: unknown format {path.suffix!r}; "
                    "expected .jsonl, .jsonl.gz, .json, .parquet or a datasets folder")


def _read_json(path: Path) -> list[tuple[str, dict]]:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}, {not_utf8(e)}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}, line {e.lineno}: malformed JSON ({e.msg})") from None
    except RecursionError:
        raise DataError(f"{path}: JSON nested too deeply to read (no data set is)") from None
    if isinstance(data, dict):  # {"data": [...]} or a column-oriented dict is not guessed at
        data = data.get("data", data.get("rows"))
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of objects (or {{\"data\": [...]}})")
    out = []
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise DataError(f"{path}, item {i}: expected a JSON object, got {type(row).__name__}")
        out.append((f"item {i}", row))
    return out


def _read_table(path: Path) -> list[tuple[str, dict]]:
    """A ``datasets`` folder saved to disk (``save_to_disk``): its train split, or its only one."""
    from datasets import load_from_disk  # (optional: emapg[math], for datasets folders)

    ds = load_from_disk(str(path))
    if hasattr(ds, "keys"):  # a DatasetDict: take the train split, or the only one
        split = "train" if "train" in ds else next(iter(ds))
        ds = ds[split]
    return [(f"row {i}", dict(row)) for i, row in enumerate(ds)]


def answer_text(value: Any, where: str | None = None) -> str:
    """A gold answer as text: a string as it is, a number as written (a whole float, AMC's 142.0, as its integer);
    anything else (a null, a list, true) is a DataError naming ``where`` (file, line, field) when given."""
    if value is None or isinstance(value, bool) or not isinstance(value, str | int | float) or (
            isinstance(value, float) and not math.isfinite(value)):  # NaN and inf: no answer (\boxed{nan} matched)
        at = f"{where}: " if where else ""
        raise DataError(f"{at}an answer is {value!r} ({type(value).__name__}); expected text or a finite number")
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def check_text(value: Any, where: str) -> None:
    """Refuse text that is not valid Unicode (a lone surrogate such as "\\ud83d", common in scraped data:
    JSON allows it, no tokenizer can encode it), naming where it is."""
    for text in value if isinstance(value, list) else [value]:
        if isinstance(text, str):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise DataError(f"{where}: not valid Unicode text (a lone surrogate {text[e.start]!r} at character "
                                f"{e.start + 1}); fix or drop the row") from None


def load_rows(path: str | Path, fields: dict[str, str] | None = None, required: tuple[str, ...] = ()) -> list[dict]:
    """Rows of a data file with columns renamed by ``fields`` (task name -> file column).

    ``required`` lists task field names every row must have (after renaming).
    """
    path = resolve(path)
    raw = list(iter_rows(path))
    if not raw:
        raise DataError(f"{path}: no rows (the file is empty)")
    fields = fields or {}
    out = []
    for where, row in raw:
        item: dict[str, Any] = dict(row)
        for name, column in fields.items():
            if column not in row:
                raise DataError(f"{path}, {where}: missing field {column!r} (mapped to {name!r}); "
                                f"the row has {', '.join(sorted(row))}")
            item[name] = row[column]
        for name in required:
            if name not in item:
                raise DataError(f"{path}, {where}: missing field {name!r}; the row has {', '.join(sorted(row))}")
            if item[name] is None:
                raise DataError(f"{path}, {where}: field {name!r} is null (expected a value)")
        for name in {*fields, *required}:
            check_text(item[name], f"{path}, {where}: field {name!r}")
        item.setdefault("id", where.replace(" ", "-"))
        item["_source"] = f"{path}, {where}"  # where a message about this row points
        out.append(item)
    return out
