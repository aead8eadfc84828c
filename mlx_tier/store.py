"""Cold tier: positioned reads of single experts from safetensors shards.

mlx-lm checkpoints store each expert projection stacked as ``[E, out, in]``
(plus ``scales``/``biases`` ``[E, out, in // group_size]`` when quantised).
Expert ``e`` is therefore one contiguous byte range inside each stacked tensor.
This module parses the safetensors headers (8-byte little-endian length, then
a JSON header with ``dtype``, ``shape`` and ``data_offsets``) and reads only
those ranges with ``os.preadv`` on a small thread pool (reads release the GIL).

No policy lives here: the cache decides *what* to read, the store reads it.
``mx.load`` is deliberately not used for experts: evaluating a slice of a
lazily loaded tensor reads the whole tensor.
"""

from __future__ import annotations

import json
import os
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# safetensors dtype -> numpy dtype used to hold the raw bytes. bfloat16 has no
# numpy dtype: it travels as uint16 and is reinterpreted by the caller.
_NP_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U64": np.uint64,
    "U32": np.uint32,
    "U16": np.uint16,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed, or not in the layout mlx-tier reads."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives on disk.

    Attributes:
        file: shard path.
        dtype: safetensors dtype string (``"U32"``, ``"BF16"``, ...).
        shape: full tensor shape.
        start: absolute byte offset of the first element in ``file``.
        nbytes: size of the whole tensor in bytes.
    """

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    nbytes: int

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(_NP_DTYPES[self.dtype])

    def expert_nbytes(self) -> int:
        """Bytes of one slice along axis 0 (one expert of a stacked tensor)."""
        return self.nbytes // self.shape[0]


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse one safetensors file header.

    Returns:
        tensor name -> TensorInfo (``__metadata__`` dropped).

    Raises:
        CheckpointError: the file is too short or its header is not valid JSON.
    """
    path = Path(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: bad safetensors header ({e})") from None
    base = 8 + n
    size = path.stat().st_size
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: bad safetensors header (not an object)")
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = meta["data_offsets"]
            dtype, shape = meta["dtype"], tuple(meta["shape"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: bad safetensors header entry for {name!r}") from None
        if dtype not in _NP_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {dtype}, which mlx-tier cannot read")
        if not 0 <= begin <= end or base + end > size:
            raise CheckpointError(f"{path}: tensor {name!r} lies outside the file (truncated download?)")
        out[name] = TensorInfo(path, dtype, shape, base + begin, end - begin)
    return out


def index_checkpoint(model_dir: Path) -> dict[str, TensorInfo]:
    """Headers of every ``*.safetensors`` shard in ``model_dir``, merged.

    Raises:
        CheckpointError: no shard found.
    """
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no .safetensors files")
    index: dict[str, TensorInfo] = {}
    for f in files:
        index.update(read_header(f))
    return index


@dataclass
class ReadStats:
    """Counters of the cold tier (read outside the hot loop)."""

    reads: int = 0  # positioned reads issued (one per tensor slice)
    bytes_read: int = 0
    read_seconds: float = 0.0  # wall time of read batches, threads overlapped


class ExpertStore:
    """Reads experts' byte ranges from a checkpoint's shards.

    Args:
        model_dir: checkpoint directory (mlx-lm format, safetensors shards).
        threads: size of the read pool; ~4 beat mmap page faults 4-5x on Macs
            (DESIGN.md, "Cold reads").
    """

    def __init__(self, model_dir: Path, threads: int = 4):
        self.model_dir = Path(model_dir)
        self.index = index_checkpoint(self.model_dir)
        self._fds: dict[Path, int] = {}
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="mlx-tier-read")
        self.stats = ReadStats()

    def info(self, name: str) -> TensorInfo:
        try:
            return self.index[name]
        except KeyError:
            raise CheckpointError(f"{self.model_dir}: tensor {name!r} not found") from None

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def _read_into(self, info: TensorInfo, expert: int, out: np.ndarray) -> None:
        size = info.expert_nbytes()
        mv = memoryview(out).cast("B")
        fd = self._fd(info.file)
        off = info.start + expert * size
        done = 0
        while done < size:  # preadv may return short counts
            n = os.preadv(fd, [mv[done:]], off + done)
            if n <= 0:
                raise CheckpointError(f"{info.file}: unexpected end of file")
            done += n

    def read_experts(self, names: list[str], experts: list[int]) -> dict[str, np.ndarray]:
        """Read the slices of ``experts`` from each stacked tensor in ``names``.

        Args:
            names: stacked tensor names, each of shape ``[E, ...]``.
            experts: expert ids, in the order the rows are wanted.

        Returns:
            name -> numpy array ``[len(experts), *shape[1:]]`` holding the raw
            on-disk dtype (bfloat16 as uint16).
        """
        out = {}
        jobs = []
        for name in names:
            info = self.info(name)
            buf = np.empty((len(experts), *info.shape[1:]), dtype=info.np_dtype)
            out[name] = buf
            for row, e in enumerate(experts):
                jobs.append((info, e, buf[row]))
        for info in {job[0].file: job[0] for job in jobs}.values():
            self._fd(info.file)  # open on this thread: the workers only read the dict
        t0 = time.perf_counter()
        for fut in [self._pool.submit(self._read_into, *job) for job in jobs]:
            fut.result()
        self.stats.read_seconds += time.perf_counter() - t0
        self.stats.reads += len(jobs)
        self.stats.bytes_read += sum(b.nbytes for b in out.values())
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self):  # best effort; close() is the real API
        try:
            self.close()
        except Exception:
            pass
