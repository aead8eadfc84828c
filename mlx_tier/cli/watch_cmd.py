"""``mlx-tier watch`` and ``mlx-tier status --html``: the job's page, live or as a file."""

from __future__ import annotations

import webbrowser
from pathlib import Path

import typer

from mlx_tier.cli.exits import fail
from mlx_tier.cli.render import err, out


def write_html(out_dir: Path) -> None:
    """Write ``OUT_DIR/report.html`` and say where; exit 2 when it cannot be written."""
    from mlx_tier.errors import InputError
    from mlx_tier.monitor.page import write_report_html

    try:
        path = write_report_html(out_dir)
    except InputError as e:
        fail(str(e))
    except OSError as e:
        fail(f"{out_dir}: cannot write report.html ({e.strerror or e})")
    err.print(f"wrote {path}", highlight=False, soft_wrap=True, markup=False)


def watch(
    out_dir: Path = typer.Argument(..., metavar="OUT_DIR", help="Output folder of a running or finished `mlx-tier run`."),
    port: int = typer.Option(8737, "--port", min=0, max=65535, help="TCP port to serve on (0: any free port)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to bind. Anything but loopback makes the page readable by anyone on that network."),
    open_browser: bool = typer.Option(False, "--open", help="Open the page in the default web browser."),
    interval: float = typer.Option(2.0, "--interval", min=0.2, help="How often the page checks for changes, seconds."),
) -> None:
    """Serve a live page of the job in OUT_DIR: progress, charts, failures and
    every summary beside its document. It only reads the job's files (journal,
    report.json, summaries) and updates itself while the job runs. Ctrl-C stops it."""
    from mlx_tier.errors import InputError
    from mlx_tier.monitor.server import WatchConfig, is_loopback, make_server, url_of

    try:
        server = make_server(WatchConfig(out_dir, host=host, port=port, interval_s=interval))
    except InputError as e:
        fail(str(e))
    except OSError as e:
        import errno
        import socket

        if isinstance(e, socket.gaierror) or e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
            fail(f"cannot serve on {host}:{port} ({e.strerror or e}): {host} is not an address of this machine; "
                 "give another with --host")
        fail(f"cannot serve on {host}:{port} ({e.strerror or e}); pick another with --port")
    url = url_of(server)
    if not is_loopback(host):
        err.print(f"[bold yellow]warning:[/] serving on {host}: anyone who can reach this machine on that "
                  "network can read the job's summaries and errors", highlight=False, soft_wrap=True)
    out.print(f"watching {out_dir} at {url} (Ctrl-C stops)", highlight=False, soft_wrap=True, markup=False)
    if open_browser:
        webbrowser.open(url)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        err.print("stopped", highlight=False)
    finally:
        server.server_close()
