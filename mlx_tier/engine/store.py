"""Cold tier: positioned reads of single experts from safetensors shards.

mlx-lm checkpoints store each expert projection stacked as ``[E, out, in]``
(plus ``scales``/``biases`` ``[E, out, in // group_size]`` when quantised).
Expert ``e`` is therefore one contiguous byte range inside each stacked tensor.
This module reads the safetensors headers (:mod:`mlx_tier.engine.checkpoint`: 8-byte length, then
a JSON header with ``dtype``, ``shape`` and ``data_offsets``) and reads only
those ranges with ``os.preadv`` on a small thread pool (reads release the GIL).

No policy lives here: the cache decides *what* to read, the store reads it.
``mx.load`` is deliberately not used for experts: evaluating a slice of a
lazily loaded tensor reads the whole tensor.

How the bytes are read is a setting (:func:`check_read_settings`):

- ``read_method``: ``"pread"`` (positioned reads straight into the destination
  array) or ``"mmap"`` (copy out of a read-only memory map of the shard; the
  page faults happen inside the copy, on the pool's threads).
- ``page_cache``: ``"keep"`` (pages stay cached), ``"drop"``
  (``posix_fadvise(POSIX_FADV_DONTNEED)`` on each range after reading it) or
  ``"direct"`` (``O_DIRECT``: the enclosing 4 KiB-aligned range is read into an
  aligned per-thread buffer and the expert's bytes are copied out; pread only;
  on macOS ``F_NOCACHE`` stands in for ``O_DIRECT``, untested here).

The defaults come from ``benches/read_methods.py`` (numbers at :data:`DEFAULT_READ_METHOD`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import numpy as np

from mlx_tier.engine.checkpoint import TensorInfo, index_checkpoint
from mlx_tier.errors import CheckpointError

READ_METHODS = ("pread", "mmap")
PAGE_CACHE_MODES = ("keep", "drop", "direct")
# Chosen by benches/read_methods.py (~2 GiB synthetic qwen3_moe, 2.5 MiB
# experts in 9 ranges, 8 experts of a layer per call, 4 threads, 2 shared
# cores, ext4 on a virtual disk; 4 repetitions of 9 runs, medians): cold,
# pread took 5.3-9.3 ms per expert and mmap 24-40 ms (4-5x slower: page-fault
# reads); direct tied with keep cold (within 3%), drop was 6-15% slower; warm,
# keep served re-reads 4x faster than drop or direct (mmap/keep was faster
# still warm, 0.8-1.6 ms, but never worth its cold cost).
DEFAULT_READ_METHOD = "pread"
DEFAULT_PAGE_CACHE = "keep"
# O_DIRECT needs offset, length and buffer address aligned to the logical
# block size; 4 KiB covers 512-byte and 4K-native disks.
DIRECT_ALIGN = 4096


def check_read_settings(read_method: str, page_cache: str) -> None:
    """Validate a read method / page-cache pair.

    Raises:
        ValueError: an unknown name, ``direct`` with ``mmap`` (a memory map
            always goes through the page cache), or a mode this platform lacks.
    """
    if read_method not in READ_METHODS:
        raise ValueError(f"read_method must be one of {', '.join(READ_METHODS)}; got {read_method!r}")
    if page_cache not in PAGE_CACHE_MODES:
        raise ValueError(f"page_cache must be one of {', '.join(PAGE_CACHE_MODES)}; got {page_cache!r}")
    if page_cache == "direct" and read_method != "pread":
        raise ValueError("page_cache='direct' (O_DIRECT) needs read_method='pread': "
                         "a memory map always goes through the page cache")
    if page_cache == "drop" and not hasattr(os, "posix_fadvise"):
        raise ValueError("page_cache='drop' needs posix_fadvise, which this platform lacks (macOS): "
                         "use 'keep' or 'direct'")
    if page_cache == "direct" and not hasattr(os, "O_DIRECT") and not hasattr(fcntl, "F_NOCACHE"):
        raise ValueError("page_cache='direct' needs O_DIRECT (Linux) or F_NOCACHE (macOS); this platform has neither")


@dataclass
class ReadStats:
    """Counters of the cold tier (read outside the hot loop)."""

    reads: int = 0  # positioned reads issued (one per tensor slice)
    bytes_read: int = 0
    read_seconds: float = 0.0  # wall time of read batches, threads overlapped


def _direct_refused(path: Path) -> CheckpointError:
    return CheckpointError(f"{path}: the filesystem refuses direct I/O (O_DIRECT); use page_cache='keep' or 'drop'")


def _pread_exact(fd: int, out: memoryview, off: int, path: Path) -> None:
    done = 0
    while done < len(out):  # preadv may return short counts
        n = os.preadv(fd, [out[done:]], off + done)
        if n <= 0:
            raise CheckpointError(f"{path}: unexpected end of file")
        done += n


def direct_reads_work(paths: list[Path]) -> bool:
    """Whether every file in ``paths`` can be read with ``O_DIRECT`` (one aligned block
    each): some filesystems (tmpfs, some network and FUSE mounts) refuse it. False
    where the platform has no ``O_DIRECT`` (macOS)."""
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        return False
    buf = mmap.mmap(-1, DIRECT_ALIGN)  # anonymous: page-aligned
    try:
        for path in paths:
            fd = os.open(path, os.O_RDONLY | flag)
            try:
                os.preadv(fd, [buf], 0)
            finally:
                os.close(fd)
    except OSError:
        return False
    finally:
        buf.close()
    return True


class ExpertStore:
    """Reads experts' byte ranges from a checkpoint's shards.

    Args:
        model_dir: checkpoint directory (mlx-lm format, safetensors shards).
        threads: size of the read pool; ~4 beat mmap page faults 4-5x on Macs
            (docs/architecture.md, "Cold reads").
        read_method: ``"pread"`` or ``"mmap"`` (module doc).
        page_cache: ``"keep"``, ``"drop"`` or ``"direct"`` (module doc).
        index: the checkpoint's tensors (:func:`mlx_tier.engine.checkpoint.index_checkpoint`),
            when the caller has it already.

    Raises:
        ValueError: a bad ``read_method``/``page_cache`` (:func:`check_read_settings`).
        CheckpointError: no shard or a malformed header; at the first read of a
            shard, a filesystem that refuses ``O_DIRECT``.
    """

    def __init__(
        self,
        model_dir: Path,
        threads: int = 4,
        read_method: str = DEFAULT_READ_METHOD,
        page_cache: str = DEFAULT_PAGE_CACHE,
        index: dict[str, TensorInfo] | None = None,
    ):
        check_read_settings(read_method, page_cache)
        self.model_dir = Path(model_dir)
        self.threads = threads
        self.read_method = read_method
        self.page_cache = page_cache
        self.index = index if index is not None else index_checkpoint(self.model_dir)
        self._fds: dict[Path, int] = {}
        self._maps: dict[Path, tuple[mmap.mmap, np.ndarray]] = {}  # shard -> (map, uint8 view of it)
        self._local = threading.local()  # per-thread aligned scratch buffer for O_DIRECT
        self._opening = threading.Lock()
        if page_cache == "direct":
            self._read = self._read_direct
        else:
            self._read = self._read_mmap if read_method == "mmap" else self._read_pread
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="mlx-tier-read")
        self.stats = ReadStats()

    def __deepcopy__(self, memo) -> ExpertStore:
        """A store of its own on the same checkpoint and settings (its own files,
        pool and counters): a copied model reads and counts for itself."""
        return ExpertStore(self.model_dir, self.threads, self.read_method, self.page_cache, self.index)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.index[name]
        except KeyError:
            raise CheckpointError(f"{self.model_dir}: tensor {name!r} not found") from None

    def _open(self, path: Path) -> None:
        """Open (and map) a shard once, on the submitting thread (the workers only read the dicts)."""
        if path in self._fds:
            return
        with self._opening:  # a prefetch thread may submit at the same time; taken once per shard
            if path not in self._fds:
                self._open_locked(path)

    def _open_locked(self, path: Path) -> None:
        direct = self.page_cache == "direct"
        flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
        try:
            fd = os.open(path, flags)
            if direct and not hasattr(os, "O_DIRECT"):  # macOS: no O_DIRECT, F_NOCACHE instead
                fcntl.fcntl(fd, fcntl.F_NOCACHE, 1)
        except OSError as e:
            if direct and e.errno == errno.EINVAL:
                raise _direct_refused(path) from None
            raise
        if self.read_method == "mmap":
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            self._maps[path] = (mm, np.frombuffer(mm, dtype=np.uint8))
        self._fds[path] = fd  # last: its presence tells other threads the shard is ready

    def _read_pread(self, info: TensorInfo, off: int, out: memoryview) -> None:
        fd = self._fds[info.file]
        _pread_exact(fd, out, off, info.file)
        if self.page_cache == "drop":
            os.posix_fadvise(fd, off, len(out), os.POSIX_FADV_DONTNEED)

    def _read_mmap(self, info: TensorInfo, off: int, out: memoryview) -> None:
        mm, view = self._maps[info.file]
        if off + len(out) > len(view):
            raise CheckpointError(f"{info.file}: unexpected end of file")
        # numpy copies without holding the GIL: the threads' page faults overlap.
        np.copyto(np.frombuffer(out, dtype=np.uint8), view[off : off + len(out)])
        if self.page_cache == "drop":
            start = off // mmap.PAGESIZE * mmap.PAGESIZE  # madvise wants a page-aligned start
            mm.madvise(mmap.MADV_DONTNEED, start, off + len(out) - start)  # unmap ours, then drop
            os.posix_fadvise(self._fds[info.file], off, len(out), os.POSIX_FADV_DONTNEED)

    def _read_direct(self, info: TensorInfo, off: int, out: memoryview) -> None:
        start = off // DIRECT_ALIGN * DIRECT_ALIGN
        end = -(-(off + len(out)) // DIRECT_ALIGN) * DIRECT_ALIGN
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < end - start:
            buf = self._local.buf = mmap.mmap(-1, end - start)  # anonymous: page-aligned
        with memoryview(buf) as whole:
            mv = whole[: end - start]
            got = 0
            try:
                while got < off + len(out) - start:  # the aligned tail may pass the end of the file
                    n = os.preadv(self._fds[info.file], [mv[got:]], start + got)
                    if n <= 0:
                        raise CheckpointError(f"{info.file}: unexpected end of file")
                    got += n
            except OSError as e:
                if e.errno == errno.EINVAL:
                    raise _direct_refused(info.file) from None
                raise
            out[:] = mv[off - start : off - start + len(out)]
            mv.release()

    def _read_into(self, info: TensorInfo, expert: int, out: np.ndarray) -> None:
        size = info.expert_nbytes()
        self._read(info, info.start + expert * size, memoryview(out).cast("B"))

    def read_experts(
        self, names: list[str], experts: list[int], out: dict[str, np.ndarray] | None = None
    ) -> dict[str, np.ndarray]:
        """Read the slices of ``experts`` from each stacked tensor in ``names``.

        All slices (``len(names) * len(experts)`` ranges) are issued together
        on the pool, whatever the read method.

        Args:
            names: stacked tensor names, each of shape ``[E, ...]``.
            experts: expert ids, in the order the rows are wanted.
            out: optional caller-owned destination per name (some of
                ``names`` or all; the others are allocated), C-contiguous,
                the on-disk dtype, shape ``[R, *shape[1:]]`` with
                ``R >= len(experts)``; rows ``[:len(experts)]`` are filled.
                Reusing them across calls saves the page faults of fresh
                memory (``benches/read_methods.py``: "reused buffers").

        Returns:
            name -> numpy array ``[len(experts), *shape[1:]]`` holding the raw
            on-disk dtype (bfloat16 as uint16): a view of ``out[name]`` when
            given, else freshly allocated and owned by the caller.

        Raises:
            CheckpointError: unknown tensor, a short file, or O_DIRECT refused.
            ValueError: an expert id out of range, or an ``out`` buffer of the
                wrong dtype, shape or layout.
        """
        got = {}
        jobs = []
        for name in names:
            info = self.info(name)
            if out is None or name not in out:
                buf = np.empty((len(experts), *info.shape[1:]), dtype=info.np_dtype)
            else:
                dest = out[name]
                if (dest.dtype != info.np_dtype or tuple(dest.shape[1:]) != info.shape[1:]
                        or dest.shape[0] < len(experts) or not dest.flags.c_contiguous):
                    raise ValueError(
                        f"out[{name!r}]: need a C-contiguous {info.np_dtype} array [>= {len(experts)}, "
                        f"{', '.join(map(str, info.shape[1:]))}], got {dest.dtype} {list(dest.shape)}"
                    )
                buf = dest[: len(experts)]
            got[name] = buf
            for row, e in enumerate(experts):
                if not 0 <= e < info.shape[0]:  # else the read would return a neighbour's bytes
                    raise ValueError(f"{name}: expert {e} out of range [0, {info.shape[0]})")
                jobs.append((info, e, buf[row]))
        for path in {job[0].file for job in jobs}:
            self._open(path)  # on this thread: the workers only read the dicts
        t0 = time.perf_counter()
        futures = [self._pool.submit(self._read_into, *job) for job in jobs]
        wait(futures)  # all of them, even past a failure: no read lands in ``out`` after this returns or raises
        for fut in futures:
            fut.result()
        self.stats.read_seconds += time.perf_counter() - t0
        self.stats.reads += len(jobs)
        self.stats.bytes_read += sum(b.nbytes for b in got.values())
        return got

    def close(self, wait: bool = True) -> None:
        """Stop the read pool (waiting for reads in flight unless ``wait`` is
        False) and release the files and maps."""
        self._pool.shutdown(wait=wait)
        maps = [mm for mm, _ in self._maps.values()]
        self._maps.clear()  # drops the uint8 views, which export the maps' buffers
        for mm in maps:
            mm.close()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # best effort; close() is the real API
        # Never wait here: a collection inside a new thread's start-up would
        # wait for that very thread (a deadlock seen under gdb in test_prefetch).
        with contextlib.suppress(AttributeError, OSError, RuntimeError, BufferError):  # half-built, or at exit
            self.close(wait=False)
