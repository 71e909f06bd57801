"""Safetensors checkpoints as files: which file holds which tensor, the tensors' shapes
read from the headers alone, and a writer that streams a checkpoint tensor by tensor.

No torch here: headers are JSON behind an 8-byte length (the safetensors format), and
the writer takes raw bytes. Reading tensors for a shard is engine/weights.py's.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# A header larger than this is no checkpoint's (the format's own limit is 100 MB).
MAX_HEADER_BYTES = 100 << 20
# Where a streamed checkpoint starts a new file (HF's save_pretrained uses 5 GB).
MAX_FILE_BYTES = 4 << 30
ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "I8": 1, "U8": 1, "I32": 4, "I64": 8}


class CheckpointError(RuntimeError):
    """The checkpoint is missing, incomplete or not in safetensors format."""


def read_header(path: Path) -> dict[str, Any]:
    """A safetensors file's header: tensor name -> {dtype, shape, data_offsets}."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path} is not a safetensors file (too short)")
        (size,) = struct.unpack("<Q", raw)
        if size > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path} has a header of {size} bytes: not a safetensors file")
        try:
            header = json.loads(f.read(size))
        except ValueError as exc:
            raise CheckpointError(f"{path} has an unreadable header: {exc}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has an unreadable header")
    header.pop("__metadata__", None)
    return header


def weight_map(directory: Path) -> dict[str, str]:
    """Tensor name -> safetensors file name, from the index or the single file."""
    index = directory / INDEX_FILE
    if index.exists():
        data = json.loads(index.read_text())
        return dict(data["weight_map"])
    single = directory / SINGLE_FILE
    if single.exists():
        return {name: SINGLE_FILE for name in read_header(single)}
    raise CheckpointError(f"{directory} holds no {SINGLE_FILE} nor {INDEX_FILE}")


def checkpoint_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, in file order and within a file in data order."""
    files = sorted(set(weight_map(directory).values()))
    shapes: dict[str, tuple[int, ...]] = {}
    for fname in files:
        header = read_header(directory / fname)
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            shapes[name] = tuple(int(s) for s in info["shape"])
    return shapes


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # safetensors' dtype name: BF16, F32, ...
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = ITEMSIZE[self.dtype]
        for s in self.shape:
            n *= s
        return n


def plan_files(specs: list[TensorSpec], max_bytes: int = MAX_FILE_BYTES) -> list[list[TensorSpec]]:
    """Consecutive tensors grouped into files of at most ``max_bytes`` (a tensor
    larger than that gets a file of its own)."""
    files: list[list[TensorSpec]] = []
    size = 0
    for spec in specs:
        if not files or (files[-1] and size + spec.nbytes > max_bytes):
            files.append([])
            size = 0
        files[-1].append(spec)
        size += spec.nbytes
    return files


class CheckpointWriter:
    """Writes a safetensors checkpoint whose tensors are known in advance, in the
    order planned, one chunk of bytes at a time (nothing is held in memory)."""

    def __init__(self, directory: Path, specs: list[TensorSpec], max_bytes: int = MAX_FILE_BYTES):
        self.directory = directory
        self.groups = plan_files(specs, max_bytes)
        n = len(self.groups)
        self.names = (
            [SINGLE_FILE]
            if n == 1
            else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        )
        self._order = [(fi, spec) for fi, group in enumerate(self.groups) for spec in group]
        self._next = 0  # index into _order of the tensor being written
        self._left = 0  # its bytes still to come
        self._file: BinaryIO | None = None
        self._file_index = -1

    def _open(self, index: int) -> None:
        if self._file is not None:
            self._file.close()
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for spec in self.groups[index]:
            header[spec.name] = {
                "dtype": spec.dtype,
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + spec.nbytes],
            }
            offset += spec.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self._file = (self.directory / self.names[index]).open("wb")
        self._file.write(struct.pack("<Q", len(raw)) + raw)
        self._file_index = index

    def write(self, name: str, chunks: Iterable[memoryview | bytes]) -> None:
        """The bytes of tensor ``name`` (the next one planned), in any number of chunks."""
        file_index, spec = self._order[self._next]
        if spec.name != name:
            raise ValueError(f"expected tensor {spec.name}, got {name}")
        if file_index != self._file_index:
            self._open(file_index)
        assert self._file is not None
        left = spec.nbytes
        for chunk in chunks:
            left -= memoryview(chunk).nbytes
            self._file.write(chunk)
        if left != 0:
            raise ValueError(f"{name}: {spec.nbytes - left} bytes written, {spec.nbytes} planned")
        self._next += 1

    def close(self) -> None:
        """Finish the last file and write the index (for more than one file)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._next != len(self._order):
            raise ValueError(f"{len(self._order) - self._next} planned tensors were not written")
        if len(self.groups) > 1:
            total = sum(spec.nbytes for _, spec in self._order)
            wmap = {spec.name: self.names[fi] for fi, spec in self._order}
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(wmap.items()))}
            (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
