"""Stopping a job on SIGINT/SIGTERM: the first signal finishes the documents
in progress, the second stops at once (:class:`StopFlag`)."""

from __future__ import annotations

import os
import signal
import threading
import time


class Interrupted(KeyboardInterrupt):
    """A second SIGINT/SIGTERM: abandon the documents in progress now. ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# After a second signal, how long the main thread has to stop by itself (raising
# Interrupted between Python bytecodes) before the watchdog ends the process.
HARD_STOP_GRACE_SECONDS = 1.0


class StopFlag:
    """Set by SIGINT/SIGTERM: finish the documents in progress, start no new one, then stop.

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
    """

    def __init__(self, on_first=lambda: None, on_abort=lambda signum: None) -> None:
        self.signal: int | None = None
        self._old: dict = {}
        self._on_first, self._on_abort = on_first, on_abort
        self._active = False
        self._pipe: tuple[int, int] | None = None
        self._old_wakeup = -1

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
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
        if self.signal is not None:
            signal.signal(signum, self._old.get(signum, signal.SIG_DFL))
            raise Interrupted(signum)
        self.signal = signum
        self._on_first()

    def _watch(self, fd: int) -> None:
        """Count SIGINT/SIGTERM as they arrive; at the second, stop the process if the main thread does not."""
        seen = 0
        with os.fdopen(fd, "rb", buffering=0) as pipe:
            while data := pipe.read(64):  # b"" once __exit__ closes the write end
                seen = self._count(data, seen)

    def _count(self, data: bytes, seen: int) -> int:
        for signum in data:
            if signum in (signal.SIGINT, signal.SIGTERM):
                seen += 1
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
