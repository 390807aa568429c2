"""Atomic writes: a temporary file in the same folder, flushed, then renamed over the target (atomic
on POSIX). A kill at any moment leaves the old file or the new one, never a part of either."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file and an atomic rename: a kill leaves the old file
    or the new one, never a part."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to ``path`` via a temporary file and an atomic rename."""
    write_text_atomic(path, json.dumps(data, indent=1))
