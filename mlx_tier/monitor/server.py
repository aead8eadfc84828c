"""``mlx-tier watch OUT_DIR``: the job's page served live on this machine.

A standard-library ``ThreadingHTTPServer`` serves two read-only routes:

* ``/`` — the page of :mod:`mlx_tier.monitor.page`, with a script that polls
* ``/api/state?since=VERSION`` — ``{"version", "view", "html"}`` (the view of
  :func:`mlx_tier.monitor.view.build_view` and the page body), or
  ``{"version", "unchanged": true}`` when the job's files have not changed
  since ``VERSION``.

The server only reads the job's files (journal, report.json, summaries); it
never writes in OUT_DIR, so it is safe beside a running job. It binds to
127.0.0.1 unless another host is asked for, and a loopback server answers only
requests addressed to a loopback name (no DNS rebinding).
"""

from __future__ import annotations

import ipaddress
import json
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from mlx_tier.monitor.page import render_body, render_page
from mlx_tier.monitor.view import build_view
from mlx_tier.outdir.layout import JOURNAL, REPORT, lock_held, progress_files

DEFAULT_PORT = 8737
REFRESH_SECONDS = 30  # rates and ETA move with the clock: a new version at least this often


@dataclass(frozen=True)
class WatchConfig:
    """Settings of the watch server.

    Attributes:
        out_dir: the job's output folder (read only).
        host: interface to bind; loopback by default.
        port: TCP port; 0 picks a free one.
        interval_s: how often the page asks for changes, seconds.
    """

    out_dir: Path
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    interval_s: float = 2.0


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def files_version(out_dir: Path, now: float | None = None) -> str:
    """A token that changes when the journal, report.json, the run's progress files (the
    prompt being read, the tokens being written, the ETA: rewritten every few seconds) or
    the run state change (and every :data:`REFRESH_SECONDS`, for the clock-based rates)."""
    parts = []
    for path in (Path(out_dir) / JOURNAL, Path(out_dir) / REPORT, *progress_files(out_dir)):
        try:
            st = path.stat()
            parts.append(f"{st.st_size}.{st.st_mtime_ns}")
        except OSError:
            parts.append("-")
    now = time.time() if now is None else now
    parts += ["r" if lock_held(out_dir) else "s", str(int(now // REFRESH_SECONDS))]
    return "-".join(parts)


def _host_name(host_header: str) -> str:
    """The name in a ``Host`` header, without port or IPv6 brackets."""
    if host_header.startswith("["):
        return host_header[1:].partition("]")[0]
    return host_header.rpartition(":")[0] if host_header.count(":") == 1 else host_header


class _State:
    """The latest rendered state, rebuilt only when :func:`files_version` changes."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.lock = threading.Lock()
        self.version: str | None = None
        self.payload: dict = {}

    def get(self) -> dict:
        with self.lock:
            version = files_version(self.out_dir)
            if version != self.version:
                view = build_view(self.out_dir)
                self.payload = {"version": version, "view": view, "html": render_body(view)}
                self.version = version
            return self.payload


# A connection that sends nothing for this long is closed (a half-sent request
# would otherwise hold its thread for ever).
IDLE_TIMEOUT_S = 10.0
# Connections waiting to be accepted (the standard library's default is 5: a
# page reloaded by many tabs at once was left unanswered).
BACKLOG = 128


class _Server(ThreadingHTTPServer):
    """The standard library's threaded server, with a deeper accept queue and quiet
    about clients that go away mid-answer (a closed tab is not an error)."""

    request_queue_size = BACKLOG
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


def _handler(state: _State, config: WatchConfig) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = IDLE_TIMEOUT_S

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            if is_loopback(config.host) and not is_loopback(_host_name(self.headers.get("Host", ""))):
                # A loopback server answers only loopback names: a web page elsewhere cannot
                # read it through a DNS name pointed at 127.0.0.1 (DNS rebinding).
                return self._send(403, "text/plain; charset=utf-8", b"forbidden: not a loopback host name")
            try:
                payload = state.get()
            except Exception as e:  # the job's files mid-rewrite, or gone: say so, keep serving
                return self._send(503, "text/plain; charset=utf-8",
                                  f"cannot read the job: {e}".encode("utf-8", "backslashreplace"))
            if url.path == "/":
                live = {"interval_ms": int(config.interval_s * 1000), "version": payload["version"]}
                return self._send(200, "text/html; charset=utf-8", render_page(payload["view"], live).encode())
            if url.path == "/api/state":
                since = parse_qs(url.query).get("since", [None])[0]
                body = {"version": payload["version"], "unchanged": True} if since == payload["version"] else payload
                return self._send(200, "application/json", json.dumps(body).encode())
            self._send(404, "text/plain; charset=utf-8", b"not found")

        def _send(self, code: int, kind: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            try:
                self.wfile.write(body)
            except ConnectionError:  # the client left (a closed tab): nothing to tell anyone
                self.close_connection = True

        def log_message(self, format, *args) -> None:  # quiet: one line per poll would flood the terminal
            pass

    return Handler


def make_server(config: WatchConfig) -> ThreadingHTTPServer:
    """A server for ``config.out_dir``, bound and ready (``serve_forever`` runs it;
    ``server_address`` gives the port chosen for ``port=0``).

    Raises:
        InputError: ``out_dir`` is not an mlx-tier output folder.
        OSError: the address is in use or cannot be bound.
    """
    out_dir = Path(config.out_dir)
    build_view(out_dir)  # fail now, with the status module's message, on a wrong folder
    cls = _Server
    if ":" in config.host:  # an IPv6 address
        cls = type("_Server6", (_Server,), {"address_family": socket.AF_INET6})
    return cls((config.host, config.port), _handler(_State(out_dir), config))


def url_of(server: ThreadingHTTPServer) -> str:
    """``http://HOST:PORT/`` of a bound server (IPv6 hosts in brackets)."""
    host, port = server.server_address[:2]
    host = f"[{host}]" if ":" in str(host) else host
    return f"http://{host}:{port}/"
