"""Document conversion in a child process that is killed past its memory or time limit.

One long-lived worker process (``python -P -m mlx_tier.job.convert_sandbox``, in
a session of its own) converts the documents one at a time, so the
converters' start (their imports: 3-6 s on a loaded 2-core machine) is paid
once per job, not per document. This process opens each
file itself (the link checks stay here, :func:`mlx_tier.fsio.open_inside`) and
hands the open descriptor to the worker over a Unix socket (``SCM_RIGHTS``):
the worker never opens a path. Each request runs under
:class:`~mlx_tier.job.convert_limits.ConversionLimits`:

- memory: this process reads the worker's resident memory every
  :data:`POLL_SECONDS` and kills it past ``memory_mb``; where the OS enforces
  it (Linux), the worker's address space may also grow by at most
  ``memory_mb`` during a request, so an allocation past it fails (MemoryError)
  and the document fails with the same reason;
- time: past :meth:`~ConversionLimits.seconds_for` the worker is killed; it
  also caps its own CPU time (``RLIMIT_CPU``) and exits when this process is
  gone, so an orphan never converts on.

A killed worker is replaced on the next request. Owns the process and the
protocol; what converting means is :func:`mlx_tier.job.doc_text.convert_stream`'s.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time

from mlx_tier.job.convert_limits import ConversionLimits

# How often the worker's memory and the clock are checked while it converts, s.
POLL_SECONDS = 0.1
# How long the worker may take to start (import the converters) on a busy machine, s.
START_SECONDS = 120.0
_HEADER = struct.Struct("!Q")  # length of the JSON message that follows, bytes


class WorkerGone(Exception):
    """The worker process ended or broke the protocol (the reason is in the message)."""


def _send(sock: socket.socket, message: dict, fd: int | None = None) -> None:
    data = json.dumps(message).encode()
    frame = _HEADER.pack(len(data)) + data
    if fd is None:
        sock.sendall(frame)
        return
    sent = socket.send_fds(sock, [frame], [fd])
    sock.sendall(frame[sent:])


def _recv_exact(sock: socket.socket, n: int, fds: list[int] | None = None) -> bytes:
    """``n`` bytes from ``sock``; descriptors passed along are appended to ``fds``.

    Raises:
        WorkerGone: the other end closed first.
        TimeoutError: the socket's timeout passed with no data (nothing lost: call again).
    """
    chunks, got = [], 0
    while got < n:
        if fds is not None:
            data, passed, _, _ = socket.recv_fds(sock, n - got, 1)
            fds.extend(passed)
        else:
            data = sock.recv(min(n - got, 1 << 20))
        if not data:
            raise WorkerGone("the converter process closed its connection")
        chunks.append(data)
        got += len(data)
    return b"".join(chunks)


class Worker:
    """The converter process of this job (started on first use, replaced after a kill).

    Thread-safe: one conversion at a time.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self.starts = 0  # processes started (a measure of the per-document cost)

    def convert(self, fd: int, name: str, suffix: str, size: int, limits: ConversionLimits) -> dict:
        """Convert the open file ``fd`` (``name``, ``suffix``, ``size`` bytes) in the worker.

        Returns:
            ``{"text", "error", "converter"}`` as the worker's
            :func:`~mlx_tier.job.doc_text.convert_stream` gave them, or ``{"error": why}``
            when a limit was hit or the worker died (it is then replaced).
        """
        request = {"name": name, "suffix": suffix, "memory_mb": limits.memory_mb, "seconds": limits.seconds_for(size)}
        with self._lock:
            for retry in (True, False):  # a worker found dead that had been idle: once more, on a fresh one
                fresh = True  # a failed start counts as fresh: not retried
                try:
                    fresh = self._ensure_started()
                    _send(self._sock, request, fd)
                    return self._await(limits.memory_mb, request["seconds"])
                except _Over as over:
                    self.stop()
                    return {"error": str(over)}
                except (WorkerGone, OSError) as e:
                    why = self._death(request["seconds"]) or f"the converter process failed ({e})"
                    self.stop()
                    if fresh or not retry:
                        return {"error": why}
        raise AssertionError("unreachable")

    def _ensure_started(self) -> bool:
        """Start the worker unless it runs; whether it was started now.

        Raises:
            WorkerGone: it did not start or did not say it was ready.
        """
        if self._proc is not None and self._proc.poll() is None:
            return False
        self.stop()
        mine, theirs = socket.socketpair()
        env = {**os.environ, "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        # -P: the working folder (often the documents') is not put on the import path.
        # A session of its own: Ctrl-C at the terminal stops the job, which then stops
        # this process; it must not die first and fail the document it converts.
        self._proc = subprocess.Popen([sys.executable, "-P", "-m", "mlx_tier.job.convert_sandbox",
                                       str(theirs.fileno())], pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                      env=env, start_new_session=True)
        theirs.close()
        self._sock, self.starts = mine, self.starts + 1
        mine.settimeout(START_SECONDS)
        try:
            ready = self._read_message()
        except TimeoutError:
            raise WorkerGone(f"it did not start within {START_SECONDS:.0f} s") from None
        if not ready.get("ready"):
            raise WorkerGone(ready.get("error", "it did not start"))
        return True

    def _read_message(self) -> dict:
        (n,) = _HEADER.unpack(_recv_exact(self._sock, _HEADER.size))
        return json.loads(_recv_exact(self._sock, n))

    def _await(self, memory_mb: int, seconds: float) -> dict:
        """The worker's reply, checking its memory and the clock every :data:`POLL_SECONDS`.

        Raises:
            _Over: past a limit (the caller kills the worker).
            WorkerGone: it died.
        """
        import psutil

        deadline = time.monotonic() + seconds
        watched = psutil.Process(self._proc.pid)
        self._sock.settimeout(POLL_SECONDS)
        while True:
            try:
                self._sock.recv(1, socket.MSG_PEEK)
                break  # a reply is coming: read it without polling
            except TimeoutError:
                pass
            _check(watched, memory_mb, deadline, seconds)
        self._sock.settimeout(None)
        reply = self._read_message()
        if reply.get("limit") == "memory":
            raise _Over(_memory_message(memory_mb))
        return reply

    def _death(self, seconds: float) -> str | None:
        """Why the worker ended, when it did (waits briefly for its exit status), else ``None``."""
        import signal

        try:
            code = self._proc.wait(timeout=1.0) if self._proc is not None else None
        except subprocess.TimeoutExpired:
            return None
        if code == -signal.SIGXCPU:
            return f"conversion took longer than {seconds:.0f} s of processor time (limit `convert_seconds`)"
        if code is not None and code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
            return f"the converter process died ({name}; out of memory?)"
        return None if code is None else f"the converter process exited (status {code})"

    def stop(self) -> None:
        """Kill the worker (if any) and forget it; the next request starts another."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
        if self._sock is not None:
            self._sock.close()
        self._proc = self._sock = None


class _Over(Exception):
    """A limit was passed (the message says which, for the user)."""


def _memory_message(memory_mb: int) -> str:
    return f"too large to convert: needed more than {memory_mb} MiB of memory (limit `convert_memory_mb`)"


def _check(watched, memory_mb: int, deadline: float, seconds: float) -> None:
    """Raise :class:`_Over` when the worker ``watched`` is past its memory or time limit.

    Raises:
        WorkerGone: it died.
    """
    import psutil

    try:
        rss = watched.memory_info().rss
    except psutil.Error:
        raise WorkerGone("it ended while converting") from None
    if rss > memory_mb * 2**20:
        raise _Over(_memory_message(memory_mb))
    if time.monotonic() > deadline:
        raise _Over(f"conversion took longer than {seconds:.0f} s (limit `convert_seconds`)")


_WORKER = Worker()
atexit.register(_WORKER.stop)


def convert(fd: int, name: str, suffix: str, size: int, limits: ConversionLimits) -> dict:
    """:meth:`Worker.convert` on this process's worker (it lives until this process
    exits or :func:`stop`, so that the next job in this process reuses it)."""
    return _WORKER.convert(fd, name, suffix, size, limits)


def stop() -> None:
    """Stop this process's worker, if any (the next conversion starts another)."""
    _WORKER.stop()


# --- the worker process ------------------------------------------------------


def _cap_resources(memory_mb: int, seconds: float) -> None:
    """Cap this (worker) process for one request: its address space may grow by
    ``memory_mb`` where the OS enforces it (an allocation past it raises
    MemoryError), its CPU time by twice ``seconds`` (SIGXCPU ends it)."""
    import resource

    import psutil

    used = resource.getrusage(resource.RUSAGE_SELF)
    cpu = int(used.ru_utime + used.ru_stime + 2 * seconds) + 1
    space = psutil.Process().memory_info().vms + memory_mb * 2**20  # from now: earlier requests' heap is not counted
    for limit, soft in ((resource.RLIMIT_AS, space), (resource.RLIMIT_CPU, cpu)):
        hard = resource.getrlimit(limit)[1]
        try:
            resource.setrlimit(limit, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
        except (ValueError, OSError):  # not enforced here (macOS: RLIMIT_AS)
            pass


def _exit_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _serve(sock: socket.socket) -> None:
    """The worker's loop: one request (JSON + an open file), one reply, until EOF."""
    from mlx_tier.job import doc_text

    doc_text.load_converters()
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    _send(sock, {"ready": True})
    while True:
        fds: list[int] = []
        try:
            (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size, fds))
            request = json.loads(_recv_exact(sock, n, fds))
        except WorkerGone:
            return
        _cap_resources(request["memory_mb"], request["seconds"])
        try:
            with os.fdopen(fds[0], "rb") as stream:
                stream.seek(0)  # the offset is shared with the sender's descriptor
                got = doc_text.convert_stream(stream, request["name"], request["suffix"])
            reply = {"text": got.text, "error": got.error, "converter": got.converter}
        except MemoryError:
            reply = {"limit": "memory"}
        except Exception as e:  # noqa: BLE001 - fails this document, not the worker
            reply = {"error": f"cannot convert ({type(e).__name__}): {e}"}
        _send(sock, reply)


if __name__ == "__main__":
    _serve(socket.socket(fileno=int(sys.argv[1])))
