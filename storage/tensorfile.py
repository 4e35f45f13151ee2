"""safetensors files written from tensor memory and read back without copies, checksummed.

The bytes are standard safetensors (an 8-byte little-endian header length, a JSON header, then
the tensor data), so ``safetensors.torch.load_file`` reads every file written here. We write
the layout ourselves rather than through ``safetensors.torch.save`` because that builds the
whole file in a fresh buffer first, and on small machines faulting in fresh pages costs more
than the disk. The checksum is computed in a second thread while the bytes go out or come in
(zlib and hashlib release the GIL), so it costs little wall time where a core is free.

Checksums are written as ``"{algorithm}:{hex digest}"``. ``crc32`` (the default of
:class:`~storage.store.CheckpointStore`) is what S3, GCS and HDFS use to catch damaged data
and is fast; ``sha256`` is there for those who want a cryptographic digest at a few times
the cost. Neither guards against someone who can also rewrite the manifest.

Reading never unpickles anything: the header is JSON, checked field by field, and the data is
raw bytes viewed as tensors of the declared dtype and shape.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import fsspec
import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem

__all__ = [
    "CHECKSUMS",
    "Encoded",
    "TensorFileError",
    "decode",
    "dtype_of",
    "encode",
    "read_verified",
    "write",
]

CHECKSUMS = ("crc32", "sha256")
"""Checksum algorithms a shard may be written with."""

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_CODES = {code: dtype for dtype, code in _DTYPES.items()}
_MAX_HEADER = 100 << 20  # the safetensors library's own limit
_CHUNK = 16 << 20  # large enough that per-chunk overhead vanishes, small enough to pipeline
_THREADED = 1 << 20  # below this a helper thread costs more than it saves


def dtype_of(code: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype code (``"F32"``), as a manifest records it."""
    try:
        return _CODES[code]
    except KeyError as err:
        raise TensorFileError(f"no supported dtype has the code {code!r}") from err


class TensorFileError(ValueError):
    """Bytes that are not a well-formed safetensors file, or that fail their checksum."""


@dataclass(frozen=True, kw_only=True)
class Encoded:
    """A safetensors file as a list of buffers to write in order, without joining them."""

    chunks: list[memoryview]
    """Header first, then each tensor's bytes; they alias the tensors' memory."""
    size: int
    """Total bytes, header included."""
    index: dict[str, list[Any]]
    """``{name: [dtype code, shape]}`` of every tensor, as recorded in the manifest."""


def encode(tensors: Mapping[str, torch.Tensor]) -> Encoded:
    """Lay ``tensors`` out as a safetensors file without copying their data.

    Tensors are ordered by element size, largest first, then by name, so that every tensor
    starts at a multiple of its element size once the header is padded to 8 bytes.

    Raises:
        ValueError: a tensor has a dtype that safetensors cannot store.
    """
    views: list[tuple[str, torch.Tensor, memoryview]] = []
    for name, tensor in tensors.items():
        if tensor.dtype not in _DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {tensor.dtype}, which safetensors lacks")
        flat = tensor.detach().cpu().contiguous()
        views.append((name, flat, memoryview(flat.reshape(-1).view(torch.uint8).numpy())))
    views.sort(key=lambda v: (-v[1].element_size(), v[0]))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, flat, view in views:
        header[name] = {
            "dtype": _DTYPES[flat.dtype],
            "shape": list(flat.shape),
            "data_offsets": [offset, offset + view.nbytes],
        }
        offset += view.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the format allows trailing spaces in the header
    prefix = memoryview(len(text).to_bytes(8, "little") + text)
    index = {name: [_DTYPES[flat.dtype], list(flat.shape)] for name, flat, _ in views}
    chunks = [prefix, *(view for _, _, view in views)]
    return Encoded(chunks=chunks, size=8 + len(text) + offset, index=index)


def write(
    fs: fsspec.AbstractFileSystem, path: str, encoded: Encoded, *, fsync: bool, checksum: str
) -> str:
    """Write ``encoded`` to ``path``; return its checksum as ``"{algorithm}:{hex}"``.

    On a local disk the chunks stream to the file (and are fsynced when ``fsync``); elsewhere
    they are joined and sent in one request, which object stores need for a single PUT.
    """
    digest = _digest(checksum)
    threaded = encoded.size >= _THREADED
    if isinstance(fs, LocalFileSystem):
        _alongside(
            lambda: _update(digest, encoded.chunks),
            lambda: _write_local(path, encoded, fsync),
            threaded=threaded,
        )
    else:
        data = b"".join(encoded.chunks)
        _alongside(lambda: digest.update(data), lambda: fs.pipe_file(path, data), threaded=threaded)
    return f"{checksum}:{digest.hexdigest()}"


def read_verified(
    fs: fsspec.AbstractFileSystem, path: str, *, size: int, checksum: str
) -> torch.Tensor:
    """Read ``path`` into a fresh uint8 tensor; it must be ``size`` bytes with ``checksum``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        TensorFileError: the size or the checksum differ, or the checksum's algorithm is
            unknown.
    """
    algorithm, _, expected = checksum.partition(":")
    if algorithm not in CHECKSUMS:
        raise TensorFileError(f"has a checksum of unknown algorithm {algorithm!r}")
    digest = _digest(algorithm)
    if isinstance(fs, LocalFileSystem):
        actual = os.path.getsize(path)
        if actual != size:
            raise TensorFileError(f"has {actual} bytes, the manifest says {size} (truncated?)")
        buf = _read_local(path, size, digest)
    else:
        data = fs.cat_file(path)
        if len(data) != size:
            raise TensorFileError(f"has {len(data)} bytes, the manifest says {size} (truncated?)")
        digest.update(data)
        # A writable copy, so tensors viewing it can be trained in place.
        buf = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())
    if digest.hexdigest() != expected:
        raise TensorFileError(f"fails its {algorithm} checksum (damaged or replaced)")
    return buf


def decode(buf: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, list[Any]]]:
    """Tensors viewing the uint8 tensor ``buf`` (no copy), and their index
    ``{name: [dtype code, shape]}``.

    Raises:
        TensorFileError: ``buf`` is not a well-formed safetensors file.
    """
    header, start = _header(buf)
    entries = sorted(
        ((name, _entry(name, spec, len(buf) - start)) for name, spec in header.items()),
        key=lambda item: item[1][2][0],
    )
    end = 0
    for name, (_, _, (first, last)) in entries:
        if first != end:
            raise TensorFileError(f"tensor {name!r} leaves a gap or overlaps at byte {first}")
        end = last
    if start + end != len(buf):
        raise TensorFileError(f"{len(buf) - start - end} trailing bytes follow the last tensor")
    tensors = {
        name: _view(buf, start + first, start + last, dtype, shape)
        for name, (dtype, shape, (first, last)) in entries
    }
    index = {name: [_DTYPES[dtype], list(shape)] for name, (dtype, shape, _) in entries}
    return tensors, index


def _header(buf: torch.Tensor) -> tuple[dict[str, Any], int]:
    if len(buf) < 8:
        raise TensorFileError(f"{len(buf)} bytes is too short for a safetensors header")
    length = int.from_bytes(buf[:8].numpy().tobytes(), "little")
    if length > min(_MAX_HEADER, len(buf) - 8):
        raise TensorFileError(f"header length {length} does not fit the file")
    try:
        header = json.loads(buf[8 : 8 + length].numpy().tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TensorFileError(f"header is not JSON: {err}") from err
    if not isinstance(header, dict):
        raise TensorFileError("header is not a JSON object")
    header.pop("__metadata__", None)
    return header, 8 + length


def _entry(name: str, spec: Any, data_size: int) -> tuple[torch.dtype, list[int], list[int]]:
    """Check one header entry and return (dtype, shape, [first, last] data offsets)."""
    if not isinstance(spec, dict) or spec.get("dtype") not in _CODES:
        raise TensorFileError(f"tensor {name!r} has no supported dtype")
    shape, offsets = spec.get("shape"), spec.get("data_offsets")
    if not (isinstance(shape, list) and all(_natural(d) for d in shape)):
        raise TensorFileError(f"tensor {name!r} has a malformed shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_natural, offsets))):
        raise TensorFileError(f"tensor {name!r} has malformed data_offsets {offsets!r}")
    dtype = _CODES[spec["dtype"]]
    nbytes = _numel(shape) * _itemsize(dtype)
    if offsets[1] - offsets[0] != nbytes or offsets[1] > data_size:
        raise TensorFileError(f"tensor {name!r}: data_offsets {offsets} do not match its shape")
    return dtype, shape, offsets


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _numel(shape: list[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _view(
    buf: torch.Tensor, first: int, last: int, dtype: torch.dtype, shape: list[int]
) -> torch.Tensor:
    raw = buf[first:last]
    if first % _itemsize(dtype):
        raw = raw.clone()  # files from other writers may misalign a tensor; copy that one
    return raw.view(dtype).reshape(shape)


# ---------------------------------------------------------------------------- I/O


class _Digest(Protocol):
    def update(self, data: Any, /) -> None: ...

    def hexdigest(self) -> str: ...


class _Crc32:
    def __init__(self) -> None:
        self._value = 0

    def update(self, data: Any) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


def _digest(algorithm: str) -> _Digest:
    if algorithm == "crc32":
        return _Crc32()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"checksum must be one of {CHECKSUMS}, got {algorithm!r}")


def _write_local(path: str, encoded: Encoded, fsync: bool) -> None:
    with open(path, "wb") as f:
        for chunk in encoded.chunks:
            f.write(chunk)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def _read_local(path: str, size: int, digest: _Digest) -> torch.Tensor:
    """Read ``size`` bytes, checksumming each chunk as soon as it has arrived."""
    # torch.empty does not zero its memory (bytearray would), so each page is touched once.
    buf = torch.empty(size, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    ready: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()

    def consume() -> None:
        while (chunk := ready.get()) is not None:
            digest.update(chunk)

    def produce() -> None:
        try:
            with open(path, "rb") as f:
                for start in range(0, size, _CHUNK):
                    piece = view[start : start + _CHUNK]
                    if f.readinto(piece) != len(piece):
                        raise TensorFileError("ended early while being read (truncated?)")
                    ready.put(piece)
                if f.read(1):
                    raise TensorFileError("grew while being read")
        finally:
            ready.put(None)  # lets consume() end, also when reading failed

    _alongside(consume, produce, threaded=size >= _THREADED)
    return buf


def _update(digest: _Digest, chunks: Iterable[memoryview]) -> None:
    for chunk in chunks:
        for start in range(0, chunk.nbytes, _CHUNK):
            digest.update(chunk[start : start + _CHUNK])


def _alongside(
    background: Callable[[], None], foreground: Callable[[], None], *, threaded: bool
) -> None:
    """Run ``background`` in a helper thread while ``foreground`` runs here; re-raise errors.

    ``foreground`` must let ``background`` finish even when it fails (the read path does so
    by always sending the end-of-queue marker). Without ``threaded`` both run here, in turn.
    """
    if not threaded:
        foreground()
        background()
        return
    errors: list[BaseException] = []

    def run() -> None:
        try:
            background()
        except BaseException as err:  # re-raised in the calling thread below
            errors.append(err)

    helper = threading.Thread(target=run, name="ringflow-checksum", daemon=True)
    helper.start()
    try:
        foreground()
    finally:
        helper.join()
    if errors:
        raise errors[0]
