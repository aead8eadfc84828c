"""Small file primitives for durable job state, with no policy: atomic writes
(temp file, fsync, rename), fsync'ed line appends cut back on failure, reads
and appends that never follow a link, stale temp clean-up.

Used by :mod:`mlx_tier.outdir.journal` (the job's journal and outputs) and by every
module that writes a file the user keeps (traces, profiles, reports).
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
import time
from pathlib import Path

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
# errno values that mean "the disk is full": the job cannot go on.
DISK_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def named(e: OSError, path: Path) -> OSError:
    """``e`` with ``path`` as its file name (an ``os.write`` error names none)."""
    return e if e.filename else type(e)(e.errno, e.strerror or str(e), str(path))
# write_atomic's temporary names: ".<name>.<8 random chars>.tmp" (older runs used tempfile.mkstemp).
_TEMP = re.compile(r"^\..+\.[A-Za-z0-9_]{8}\.tmp$")
# A temp file younger than this may belong to a live writer (``status --html`` runs beside a job).
STALE_AFTER_S = 120.0


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (no-op where directories can't be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _create_temp(path: Path) -> tuple[int, Path]:
    """A new, empty temporary file beside ``path``, named like :data:`_TEMP`.

    Created with mode 0666, so the kernel applies the process umask (reading
    the umask would set it, briefly, for every thread).
    """
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(path))


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write ``data`` (text as UTF-8, or bytes) to ``path`` so that it exists only when complete.

    Raises:
        OSError: the directory is not writable or the disk is full; ``path``
            is then untouched and no temporary file is left. Its
            ``filename`` is ``path``.
    """
    path = Path(path)
    fd, tmp = _create_temp(path)
    try:
        try:
            # surrogateescape: a path that is not valid UTF-8 (inputs.txt) is written back as its own bytes
            view = memoryview(data.encode("utf-8", "surrogateescape") if isinstance(data, str) else data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, OSError):
            raise named(e, path) from None
        raise
    fsync_dir(path.parent)


def _is_old_file(path: Path, cutoff: float) -> bool:
    try:
        st = path.lstat()
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_mtime < cutoff


def remove_stale_temps(out_dir: Path, older_than_s: float = STALE_AFTER_S) -> list[str]:
    """Delete :func:`write_atomic` temporary files a killed run left in ``out_dir``.

    Call while holding the folder's lock. Readers that write beside a job
    without its lock (``mlx-tier status --html``) may have a temp file open,
    so only files unmodified for ``older_than_s`` seconds are removed; a
    younger leftover is removed by a later run.

    Returns:
        the names removed.
    """
    removed = []
    cutoff = time.time() - older_than_s
    for p in Path(out_dir).iterdir():
        if _TEMP.match(p.name) and _is_old_file(p, cutoff):
            try:
                p.unlink()
                removed.append(p.name)
            except FileNotFoundError:
                pass
    return removed


def open_inside(root: Path, path: Path) -> int:
    """A read-only descriptor of ``path``, a real (link-free) path in the folder
    ``root``, opened one component at a time from ``root`` without following a
    link, so that a folder swapped for a link between resolving ``path`` and
    opening it is refused, not followed out of ``root`` (``openat`` with
    ``O_NOFOLLOW``; POSIX). Where the OS has no ``dir_fd`` opening, ``path``
    itself is opened without following a final link.

    Raises:
        OSError: naming ``path``; ``ELOOP`` or ``ENOTDIR`` where a component is
            now a link; ``ValueError``: ``path`` does not lie in ``root``.
    """
    rel = Path(path).relative_to(root)
    try:
        if os.open not in os.supports_dir_fd or not rel.parts:
            return os.open(path, os.O_RDONLY | _NOFOLLOW)
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for part in rel.parts[:-1]:
                inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=fd)
                os.close(fd)
                fd = inner
            return os.open(rel.parts[-1], os.O_RDONLY | _NOFOLLOW, dir_fd=fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise named(e, path) from None


def read_nofollow(path: Path) -> bytes:
    """The bytes of ``path``, refusing a link (``OSError`` ``ELOOP``, naming the file)."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except OSError as e:
        raise named(e, path) from None
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _last_line_end(fd: int, size: int, block: int = 1 << 16) -> int:
    """Offset just past the last newline of the open file ``fd`` of ``size`` bytes (0: none)."""
    end = size
    while end > 0:
        start = max(0, end - block)
        cut = os.pread(fd, end - start, start).rfind(b"\n")
        if cut >= 0:
            return start + cut + 1
        end = start
    return 0


def _append_line(path: Path, line: bytes) -> None:
    """Append one line and fsync; a torn last line (no newline: a crash or power
    cut mid-append) is cut off first, so the file holds whole lines only and
    every reader (``jq`` included) reads all of it.

    Never follows a link at ``path`` (``O_NOFOLLOW``); if the write fails (disk
    full) the file is cut back to its old length.

    Raises:
        OSError: with ``filename`` set; ``ELOOP`` for a link.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | _NOFOLLOW, 0o666)
    except OSError as e:
        raise named(e, path) from None
    try:
        size = os.fstat(fd).st_size
        if size > 0 and os.pread(fd, 1, size - 1) != b"\n":  # a torn line: cut it off
            size = _last_line_end(fd, size)
            os.ftruncate(fd, size)
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except OSError as e:
            try:
                os.ftruncate(fd, size)
            except OSError:
                pass
            raise named(e, path) from None
    finally:
        os.close(fd)


def current_folder() -> str | None:
    """This process's working folder, ``None`` when it is gone (removed under it)."""
    try:
        return os.getcwd()
    except OSError:
        return None


def user_cache_dir() -> Path:
    """Where mlx-tier keeps what it builds (the demo model, profiles of models in
    read-only folders): ``$MLX_TIER_CACHE``, else the platform's user cache folder."""
    env = os.environ.get("MLX_TIER_CACHE")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("mlx-tier"))


_DIGESTS: dict[str, str] = {}  # this process's digests by file identity, where the cache cannot keep them


def _identity(path: Path, st: os.stat_result) -> str:
    return f"{os.path.realpath(path)}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}"


def _digest_kept_at(ident: str) -> Path:
    """Where :func:`file_sha256` keeps the digest of the file of identity ``ident``."""
    import hashlib

    return user_cache_dir() / "digests" / hashlib.sha256(ident.encode("utf-8", "surrogateescape")).hexdigest()[:32]


def _kept(ident: str) -> str | None:
    if ident in _DIGESTS:
        return _DIGESTS[ident]
    try:
        digest = _digest_kept_at(ident).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return digest if re.fullmatch(r"[0-9a-f]{64}", digest) else None


def kept_sha256(path: Path) -> str | None:
    """The digest :func:`file_sha256` kept of ``path`` as it is now, ``None``: none kept
    (or the file cannot be read)."""
    try:
        return _kept(_identity(path, os.stat(path)))
    except OSError:
        return None


def digests_kept() -> bool:
    """Whether :func:`file_sha256` can keep digests beyond this process (its cache folder
    can be written)."""
    folder = user_cache_dir() / "digests"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK)


def file_sha256(path: Path) -> str:
    """The sha256 (hex) of a file's bytes. It is kept in ``user_cache_dir()/digests/`` under
    the file's identity: its real path, device, inode, size, and modification and change
    times in ns (the change time moves with any write to the file and cannot be set back
    by a program), so a file rewritten in any way is read again, and one not changed
    is read once; where the cache cannot be written, for this process only.

    Raises:
        OSError: the file cannot be read.
    """
    import hashlib

    with open(path, "rb") as f:
        ident = _identity(path, os.fstat(f.fileno()))
        digest = _kept(ident)
        if digest is not None:
            return digest
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    _DIGESTS[ident] = digest
    try:
        at = _digest_kept_at(ident)
        at.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(at, digest + "\n")
    except OSError:
        pass
    return digest
