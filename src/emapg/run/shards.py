"""Whole-tensor safetensors files that each rank writes and reads by its own rows.

A checkpoint holds whole tensors: one format for any number of processes, read by safetensors, transformers
and ``emapg export``. Yet no rank holds more than its shard, at save or at resume. FSDP2 shards each tensor
along its first dimension in ``torch.chunk``'s blocks, and the rows of a row-major tensor are one run of bytes
in the file. So rank 0 writes the header and sizes the file (:func:`create`), every rank writes its rows in
place (:func:`write_rows`), and a resuming rank reads only its rows (:class:`Tensors`, safetensors'
``get_slice`` over a memory map). A tensor that is not sharded is written whole by rank 0. The ranks share a
filesystem (one node; several nodes: the run folder on a shared filesystem, as its config already is).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from emapg.errors import CheckpointError

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}


def chunk_rows(length: int, world: int, rank: int) -> tuple[int, int]:
    """(first row, number of rows) of block ``rank`` of ``length`` rows cut as ``torch.chunk`` cuts them."""
    per = -(-length // world)
    start = min(rank * per, length)
    return start, min(length, start + per) - start


@dataclass(frozen=True)
class Piece:
    """What one rank writes of a whole tensor: ``local`` (its rows from ``row``; None: another rank's)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    row: int
    local: Tensor | None


def _dtensor_rows(t: Tensor) -> tuple[int, Tensor] | None:
    """(first row, local rows) of a DTensor sharded on dim 0 over a 1-D mesh; None for a plain tensor."""
    if not isinstance(t, DTensor):
        return None
    if t.device_mesh.ndim != 1 or tuple(t.placements) != (Shard(0),):
        raise ValueError(f"a tensor sharded as {t.placements} over a {t.device_mesh.ndim}-D mesh: expected Shard(0)")
    start, count = chunk_rows(t.shape[0], t.device_mesh.size(), t.device_mesh.get_local_rank())
    local = t.to_local()
    if local.shape[0] != count:
        raise RuntimeError(f"a shard of {local.shape[0]} rows where torch.chunk's block has {count}")
    return start, local


def pieces(tensors: Mapping[str, Tensor], main: bool) -> list[Piece]:
    """This rank's pieces of ``tensors`` (DTensors: its rows; plain tensors: whole on ``main``, else none)."""
    out = []
    for name, t in tensors.items():
        if t.dtype not in DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors name here")
        sharded = _dtensor_rows(t)
        row, local = sharded if sharded is not None else (0, t if main else None)
        out.append(Piece(name, tuple(t.shape), t.dtype, row, None if local is None else local.detach()))
    return out


def _layout(parts: list[Piece]) -> tuple[bytes, dict[str, int]]:
    """The file's header (8-byte length, then JSON padded to 8 bytes) and each tensor's first byte in the data."""
    header, begin, offset = {}, {}, 0
    for p in sorted(parts, key=lambda p: p.name):
        nbytes = p.dtype.itemsize * int(torch.Size(p.shape).numel())
        header[p.name] = {"dtype": DTYPES[p.dtype], "shape": list(p.shape), "data_offsets": [offset, offset + nbytes]}
        begin[p.name] = offset
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    head = struct.pack("<Q", len(text)) + text
    return head, {**begin, "": len(head) + offset}


def create(file: Path, parts: list[Piece]) -> None:
    """Write the header and size the file (rank 0, before any rank writes its rows)."""
    head, begin = _layout(parts)
    with open(file, "wb") as f:
        f.write(head)
        f.truncate(begin[""])


def write_rows(file: Path, parts: list[Piece]) -> None:
    """Write this rank's rows of every tensor in place, then flush them to disk."""
    head, begin = _layout(parts)
    with open(file, "r+b") as f:
        for p in parts:
            if p.local is None or p.local.numel() == 0:
                continue
            row_bytes = p.dtype.itemsize * int(torch.Size(p.shape[1:]).numel()) if p.shape else 0
            f.seek(len(head) + begin[p.name] + p.row * row_bytes)
            data = p.local.contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
            f.write(memoryview(data))
        f.flush()
        os.fsync(f.fileno())


class Tensors(Mapping):
    """A safetensors file read lazily: ``tensors[name]`` is a whole tensor, :meth:`local` this rank's rows of
    one (what a DTensor laid out as ``like`` holds). Opening reads the header only (a damaged file raises)."""

    def __init__(self, file: Path):

        self.file = Path(file)
        self._f = safe_open(str(file), "pt")
        self._names = list(self._f.keys())

    def __getitem__(self, name: str) -> Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self._f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def shape(self, name: str) -> list[int]:
        """The whole shape of ``name`` (from the header: nothing is read)."""
        return list(self._f.get_slice(name).get_shape())

    def local(self, name: str, like: Tensor) -> Tensor:
        """The rows of ``name`` that this rank holds of a tensor laid out as ``like`` (whole: not a DTensor)."""
        sharded = _dtensor_rows(like)
        if sharded is None:
            return self[name]
        start, local = sharded
        if name not in self._names:
            raise KeyError(name)
        whole = self._f.get_slice(name)
        if list(whole.get_shape()) != list(like.shape):
            raise CheckpointError(f"{self.file}: {name} has shape {whole.get_shape()}, the model's is "
                                  f"{list(like.shape)}")
        return whole[start : start + local.shape[0]]


class Rows(Mapping):
    """The names of a :class:`Tensors` file, each read by ``read(name)`` when asked (a rank's rows, or whole): a
    loader that takes one tensor at a time never holds the whole file."""

    def __init__(self, tensors: Tensors, read):
        self.tensors, self.read = tensors, read

    def __getitem__(self, name: str) -> Tensor:
        return self.read(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)
