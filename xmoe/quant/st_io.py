"""Streaming safetensors I/O for files too large to load: header parsing with validation, byte-range
reads, and a writer that streams tensors into a new file.

The safetensors library reads and writes whole files (or memory-maps tensors one at a time), but copying a
95 GiB shard byte for byte with bounded memory needs the raw layout: an 8-byte little-endian header length,
a JSON header of {name: {dtype, shape, data_offsets}}, then the data.
"""
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPE_SIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
              "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
TORCH_DTYPE = {torch.int16: "I16", torch.int32: "I32", torch.float16: "F16", torch.float32: "F32",
               torch.bfloat16: "BF16", torch.uint8: "U8", torch.int8: "I8"}
CHUNK = 16 << 20


class CheckpointError(ValueError):
    """A source or output file that cannot be used; the message names the file and tensor."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def read_header(path: str | os.PathLike) -> tuple[list[TensorInfo], dict]:
    """Tensors of a safetensors file in storage order, and its metadata; checks sizes against the file."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated, no safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > min(size - 8, 100 << 20):
            raise CheckpointError(f"{path}: corrupt header length {n} for a file of {size} bytes")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    meta = header.pop("__metadata__", {}) or {}
    tensors = []
    for name, h in header.items():
        try:
            dtype, shape, (a, b) = h["dtype"], tuple(h["shape"]), h["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name}: malformed header entry {h}") from None
        if dtype not in DTYPE_SIZE:
            raise CheckpointError(f"{path}: tensor {name}: unsupported dtype {dtype}")
        numel = 1
        for d in shape:
            numel *= d
        if b - a != numel * DTYPE_SIZE[dtype]:
            raise CheckpointError(f"{path}: tensor {name}: {b - a} bytes for shape {shape} of {dtype}")
        if 8 + n + b > size:
            raise CheckpointError(f"{path}: truncated: tensor {name} ends at byte {8 + n + b}, file has {size}")
        tensors.append(TensorInfo(name, dtype, shape, 8 + n + a, b - a))
    return sorted(tensors, key=lambda t: t.start), meta


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


class ShardWriter:
    """Writes a safetensors file whose tensor list is known up front, streaming the data in order.

    Used as a context manager: data goes to `<path>.tmp`, which is fsynced and renamed to `path` only when
    every declared byte was written, so a file under its final name is always complete.
    """

    def __init__(self, path: str | os.PathLike, entries: list[tuple[str, str, tuple[int, ...]]],
                 metadata: dict | None = None):
        self.path, self.tmp = Path(path), Path(str(path) + ".tmp")
        header, offset = {}, 0
        if metadata:
            header["__metadata__"] = metadata
        self.expected = []
        for name, dtype, shape in entries:
            nbytes = DTYPE_SIZE[dtype]
            for d in shape:
                nbytes *= d
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self.expected.append((name, nbytes))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        self.header = raw + b" " * (-len(raw) % 8)  # 8-byte aligned data, as safetensors writes it
        self.index = 0

    def __enter__(self):
        self.file = open(self.tmp, "wb")
        self.file.write(struct.pack("<Q", len(self.header)) + self.header)
        return self

    def write(self, name: str, chunks) -> None:
        """Write the next declared tensor from an iterable of byte chunks."""
        want_name, want = self.expected[self.index]
        if name != want_name:
            raise RuntimeError(f"{self.path}: expected tensor {want_name}, got {name}")
        got = 0
        for chunk in chunks:
            try:
                self.file.write(chunk)
            except OSError as e:  # a full disk, typically: name the file and tensor
                raise CheckpointError(f"{self.tmp}: writing tensor {name}: {e.strerror or e}") from e
            got += len(chunk)
        if got != want:
            raise CheckpointError(f"{self.path}: tensor {name}: wrote {got} bytes, expected {want}")
        self.index += 1

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None:
                if self.index != len(self.expected):
                    raise RuntimeError(f"{self.path}: only {self.index} of {len(self.expected)} tensors written")
                self.file.flush()
                os.fsync(self.file.fileno())
        finally:
            self.file.close()
        if exc_type is None:
            os.replace(self.tmp, self.path)
        else:
            self.tmp.unlink(missing_ok=True)


def copy_chunks(path: str | os.PathLike, info: TensorInfo, chunk: int = CHUNK):
    """The raw bytes of one tensor, read in bounded chunks."""
    with open(path, "rb") as f:
        f.seek(info.start)
        left = info.nbytes
        while left:
            data = f.read(min(chunk, left))
            if not data:
                raise CheckpointError(f"{path}: tensor {info.name}: file ended {left} bytes early")
            left -= len(data)
            yield data
