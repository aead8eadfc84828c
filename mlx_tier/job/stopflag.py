"""Stopping a job on SIGINT/SIGTERM/SIGHUP: the first signal finishes the documents
in progress, the second stops at once (:class:`StopFlag`). A hang-up (the terminal
closed, an SSH session dropped) stops as SIGTERM does, its output sent to the null device
first: the terminal it would write to is gone."""

from __future__ import annotations

import os
import signal
import stat
import threading
import time


class Interrupted(KeyboardInterrupt):
    """A second stop signal: abandon the documents in progress now. ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# The signals that stop a job (SIGHUP where the platform has it).
STOP_SIGNALS = tuple(sig for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if sig is not None)


def hung_up() -> None:
    """Point standard output and error at the null device where they are a terminal: after
    a hang-up every write to it fails (EIO), and the job would end on the first message
    instead of stopping cleanly. A log file or a pipe is kept. A hung-up terminal is no
    longer a tty to ``isatty`` (its ioctl fails): any character device is taken."""
    null = None
    for fd in (1, 2):
        try:
            if stat.S_ISCHR(os.fstat(fd).st_mode):
                null = os.open(os.devnull, os.O_WRONLY) if null is None else null
                os.dup2(null, fd)
        except OSError:
            pass
    if null is not None and null > 2:
        os.close(null)


# After a second signal, how long the main thread has to stop by itself (raising
# Interrupted between Python bytecodes) before the watchdog ends the process.
HARD_STOP_GRACE_SECONDS = 1.0
# After a first signal, how long the main thread has to take it (its handler) before
# the watchdog does: a step deep inside MLX or the kernel near the memory limit.
ACK_SECONDS = 0.5
# After a first signal, how long the summaries being written have to finish before the
# job leaves them for the next run and stops (mlx_tier.job.run): a first stop that
# takes minutes is no stop (a container runtime's SIGKILL follows SIGTERM after 10 s).
STOP_GRACE_SECONDS = 8.0


class StopFlag:
    """Set by SIGINT/SIGTERM/SIGHUP: finish the documents in progress, start no new one, then stop.

    A second signal stops at once. Python runs signal handlers only between
    bytecodes of the main thread, so during a long MLX call (a prompt step can
    take minutes on a CPU) the handler waits, and two signals that arrive
    meanwhile run it once. So the signals are also counted where they arrive:
    Python's C-level handler writes one byte per signal to a wakeup fd
    (``signal.set_wakeup_fd``), which a watchdog thread reads. At the second
    signal the main thread gets :data:`HARD_STOP_GRACE_SECONDS` to raise
    :class:`Interrupted` itself (restoring the default handler, so a third
    signal kills); if it has not left the ``with`` block by then, the watchdog
    calls ``on_abort(signum)`` and ends the process (``os._exit``, 128 +
    signum). Finished summaries are safe either way: each was written
    atomically and journalled (fsync) before it was reported.

    The first signal is taken by the watchdog too when the main thread has not
    run its handler within :data:`ACK_SECONDS` (a long step): :attr:`signal`
    is set and ``on_first`` called from the watchdog's thread, so the notice
    and the progress file say "stopping" at once; :attr:`since` is when.
    """

    def __init__(self, on_first=lambda: None, on_abort=lambda signum: None) -> None:
        self.signal: int | None = None
        self.since: float | None = None  # time.monotonic() of the first signal
        self._lock = threading.Lock()
        self._handled = 0  # handler runs in the main thread
        self._old: dict = {}
        self._on_first, self._on_abort = on_first, on_abort
        self._active = False
        self._pipe: tuple[int, int] | None = None
        self._old_wakeup = -1

    def __enter__(self):
        for sig in STOP_SIGNALS:
            if sig == getattr(signal, "SIGHUP", None) and signal.getsignal(sig) is signal.SIG_IGN:
                continue  # started under nohup: a hang-up is to be ignored, the job goes on
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: no handlers, no clean stop
                return self
        self._active = True
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._pipe = (r, w)
        self._old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(r,), name="mlx-tier-stop-watchdog", daemon=True).start()
        return self

    def _handle(self, signum, frame):
        if signum == getattr(signal, "SIGHUP", None):
            hung_up()
        with self._lock:
            self._handled += 1
            first = self._handled == 1
            taken = first and self._take(signum)
        if not first:
            signal.signal(signum, self._old.get(signum, signal.SIG_DFL))
            raise Interrupted(signum)
        if taken:
            self._on_first()

    def _take(self, signum: int) -> bool:
        """Record the first signal (under the lock); False when the other thread did already."""
        if self.signal is not None:
            return False
        self.signal, self.since = signum, time.monotonic()
        return True

    def _acknowledge(self, signum: int) -> None:
        """The watchdog's take of a first signal the main thread has not handled yet."""
        with self._lock:
            taken = self._active and self._take(signum)
        if taken:
            self._on_first()

    def seconds_stopping(self) -> float:
        """Seconds since the first signal (0 before one)."""
        return time.monotonic() - self.since if self.since is not None else 0.0

    def _watch(self, fd: int) -> None:
        """Count the stop signals as they arrive; at the second, stop the process if the main thread does not."""
        seen = 0
        with os.fdopen(fd, "rb", buffering=0) as pipe:
            while data := pipe.read(64):  # b"" once __exit__ closes the write end
                seen = self._count(data, seen)

    def _count(self, data: bytes, seen: int) -> int:
        for signum in data:
            if signum in STOP_SIGNALS:
                if signum == getattr(signal, "SIGHUP", None):
                    hung_up()  # before the notice: the main thread may be deep in a step
                seen += 1
                if seen == 1:
                    ack = threading.Timer(ACK_SECONDS, self._acknowledge, (signum,))
                    ack.daemon = True
                    ack.start()
                if seen >= 2:
                    time.sleep(HARD_STOP_GRACE_SECONDS)
                    if self._active:
                        self._on_abort(signum)
                        os._exit(128 + signum)
        return seen

    def __exit__(self, *exc):
        self._active = False
        if self._pipe is not None:
            signal.set_wakeup_fd(self._old_wakeup)
            os.close(self._pipe[1])  # the watchdog reads end-of-file and returns
            self._pipe = None
        for sig, old in self._old.items():
            signal.signal(sig, old)
