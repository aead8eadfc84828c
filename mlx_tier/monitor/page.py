"""The job's page: one HTML document built from :func:`mlx_tier.monitor.view.build_view`.

The same body serves the live page of ``mlx-tier watch`` (which swaps it in
when the job's files change) and the static ``OUT_DIR/report.html`` (written at
the end of every run and by ``mlx-tier status OUT_DIR --html``), which opens
from the file system with no server and loads nothing from the network.

Charts are SVG drawn on the Python side by pygal (https://www.pygal.org),
inline in the page, with pygal's tooltip script turned off (it would come from
a CDN): the page works offline and every point is an SVG ``circle.dot`` with a
``desc`` giving its value. Each chart has a caption in words; states are named
in text, never told by colour alone; the layout is one column at phone width.
"""

from __future__ import annotations

import datetime as dt
import html
import json
import re
from pathlib import Path

from mlx_tier.fsio import write_atomic
from mlx_tier.monitor.view import build_view
from mlx_tier.outdir.journal import options_apart, short_fingerprint
from mlx_tier.outdir.layout import REPORT_HTML
from mlx_tier.rates import DEFINITION
from mlx_tier.units import duration_text, percent_text, rate_text, tokens_text

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#1a1a1a;background:#fafafa;line-height:1.4}
main,header{max-width:1100px;margin:0 auto;padding:0 12px}
h1{font-size:1.3rem;margin:12px 0 4px;overflow-wrap:anywhere}h2{font-size:1.1rem;margin:20px 0 6px}
h3{font-size:1rem;margin:4px 0}
.numbers{display:grid;grid-template-columns:repeat(auto-fill,minmax(140px,1fr));gap:8px;margin:0}
.numbers div{background:#fff;border:1px solid #ccc;border-radius:6px;padding:6px 10px}
.numbers dt{font-size:.8rem;color:#444}.numbers dd{margin:0;font-size:1.3rem;font-weight:600}
.charts{display:grid;grid-template-columns:repeat(auto-fit,minmax(min(100%,420px),1fr));gap:12px;align-items:start}
figure{margin:0;background:#fff;border:1px solid #ccc;border-radius:6px;padding:6px}
figure svg{width:100%;height:auto;display:block}figcaption{font-size:.85rem;color:#333}
.scroll{overflow-x:auto}table{border-collapse:collapse;font-size:.85rem}
td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}th{background:#eee}
td.name,th.name{text-align:left}code,pre{overflow-wrap:anywhere;white-space:pre-wrap}
pre.summary{background:#fff;border-left:3px solid #888;padding:6px 10px;margin:4px 0 10px}
details{margin:2px 0}summary{cursor:pointer;overflow-wrap:anywhere}
.failed{color:#a00}.done{color:#060}.pending{color:#555}.note{font-size:.85rem;color:#444}
"""
# Nothing from outside: inline styles; the live page's own polling script only; data: icon.
_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
_CSP_LIVE = _CSP + "; script-src 'unsafe-inline'; connect-src 'self'"
_PYGAL_SCRIPT = re.compile(r"<script[^>]*>.*?</script>", re.DOTALL)
_MARK = {"done": "✓ done", "failed": "✗ failed", "pending": "… pending"}


def _e(value) -> str:
    return html.escape(str(value), quote=True)


def fmt_seconds(s: float | None) -> str:
    """``None`` → ``"unknown"``; else :func:`~mlx_tier.units.duration_text`: ``"0.4 s"``,
    ``"42 s"``, ``"2 min 59 s"`` or ``"3 h 05 min"``."""
    return "unknown" if s is None else duration_text(s)


def _number(key: str, label: str, value: str) -> str:
    return f'<div><dt>{_e(label)}</dt><dd id="n-{key}" data-value="{_e(value)}">{_e(value)}</dd></div>'


def numbers_section(view: dict) -> str:
    """Done / failed / pending, ETA, rates: each number in ``<dd id="n-KEY">``."""
    s = view["status"]
    unknown = "?"
    state = (f"starting (pid {s['pid']})" if s.get("starting") else f"running (pid {s['pid']})") if s["running"] \
        else s["state"]
    eta = (fmt_seconds(s["eta_seconds"]) if s["eta_seconds"] is not None else "estimating") if s["running"] \
        else "not running"
    noun = s.get("noun") or "document"  # "request": a batch request file's job
    items = [
        ("state", "State", state),
        ("total", f"{noun.capitalize()}s", unknown if s["total"] is None else str(s["total"])),
        ("done", "Done", str(s["done"])),
        ("failed", "Failed", str(s["failed"])),
        ("pending", "Pending", unknown if s["pending"] is None else str(s["pending"])),
        ("eta", "ETA", eta),
        ("docs-per-hour", f"{noun.capitalize()}s / hour", rate_text(s["documents_per_hour"])),
        ("tok-s", "Output tok/s", f"{s['output_tok_per_s']:.2f}"),
        ("generation", "Generation time", fmt_seconds(s["elapsed_seconds"])),
        ("loading", "Loading time", fmt_seconds(s["load_seconds"])),
        ("redone-stale", f"Redone: {noun} changed", str(s["redone_stale"])),
        ("throttled", "Throttled or paused", fmt_seconds(s["throttled_seconds"])),
    ]
    if s["redone_changed"]:
        items.insert(-1, ("redone-changed", "Redone: model or prompt", str(s["redone_changed"])))
    cells = "".join(_number(*item) for item in items)
    done = "requests answered" if noun == "request" else "documents summarised"
    whose = ("The last run had nothing to do; the rates of the run before it" if s.get("idle_rerun")
             else "A run is loading its model; no rates yet" if s.get("starting") and s.get("started") is None
             else "A run is loading its model; the rates of the run before it" if s.get("starting")
             else "This run's rates")
    note = f"{whose}: {done} per hour and output tokens per second, {DEFINITION}."
    resume = ""
    if view.get("resume_command"):  # not running, documents left: how to go on
        resume = (f'<p id="state-note">{_e(view["state_text"])}. Resume with:</p>'
                  f'<pre id="resume-command">{_e(view["resume_command"])}</pre>')
    return (f'<section id="progress"><h2>Progress</h2><dl class="numbers">{cells}</dl><p class="note">{note}</p>'
            f'{resume}</section>')


def _chart(title: str, y_title: str, series: list[tuple[str, list, dict]], caption: str, key: str,
           percent: bool = False) -> str:
    """One pygal time chart as an inline SVG ``<figure id="chart-KEY">``.

    Args:
        series: ``(name, [(unix_seconds, value)], pygal series options)``; the
            first series' points are the chart's ``circle.dot`` elements
            (later ones are reference lines drawn without dots).
    """
    if not series[0][1]:  # nothing to draw: say so in words, no empty axes
        return (f'<figure id="chart-{key}" data-points="0" role="group" aria-label="{_e(title)}">'
                f'<h3>{_e(title)}</h3><figcaption>{_e(caption)}</figcaption></figure>')
    import pygal
    from pygal.style import DefaultStyle

    style = DefaultStyle(font_family="system-ui, sans-serif", label_font_size=13, major_label_font_size=13,
                         title_font_size=17, legend_font_size=13, background="#fff", plot_background="#fff")
    times = [t for _, points, _ in series for t, _ in points]
    clock = "%H:%M:%S" if times and max(times) - min(times) < 600 else "%H:%M"
    chart = pygal.DateTimeLine(
        js=[], disable_xml_declaration=True, show_legend=len(series) > 1, legend_at_bottom=True,
        width=560, height=300, title=title, x_title="time (local)", y_title=y_title, truncate_label=-1,
        x_value_formatter=lambda d: d.strftime(clock), x_label_rotation=0, include_x_axis=True,
        value_formatter=percent_text if percent else (lambda v: f"{v:.3g}"),
        no_data_text="no data yet", margin=8, margin_right=32, style=style, dots_size=3.5,
        x_labels=_time_labels(times),
    )
    if percent:
        chart.range = (0, 1)
    for name, points, opts in series:
        chart.add(name, [(dt.datetime.fromtimestamp(t), v) for t, v in points], **opts)
    # pygal always embeds its config for the tooltip script (turned off above): drop it, the page runs no chart code.
    svg = _PYGAL_SCRIPT.sub("", chart.render(is_unicode=True))
    return (f'<figure id="chart-{key}" data-points="{len(series[0][1])}" role="group" aria-label="{_e(title)}">'
            f'{svg}<figcaption>{_e(caption)}</figcaption></figure>')


def _time_labels(times: list[float], n: int = 4) -> list[dt.datetime] | None:
    """``n`` evenly spaced x labels over ``times`` (pygal's own crowd on short spans); ``None`` when empty."""
    if not times:
        return None
    lo, hi = min(times), max(times)
    count = n if hi > lo else 1
    return [dt.datetime.fromtimestamp(lo + (hi - lo) * i / max(count - 1, 1)) for i in range(count)]


SHARED = "documents finishing in the same step share one point"


def _describe(points: list, unit: str, fmt=lambda v: f"{v:.3g}", per: str = "one per finished or failed document"
              ) -> str:
    if not points:
        return "No point yet: points are added as documents finish."
    values = [v for _, v in points]
    count = "1 point" if len(points) == 1 else f"{len(points)} points"
    return (f"{count}, {per}; latest {fmt(values[-1])}{unit}, "
            f"lowest {fmt(min(values))}{unit}, highest {fmt(max(values))}{unit}.")


def _points(samples: list[dict], key: str, scale: float = 1.0) -> list[tuple[float, float]]:
    return [(s["time"], s[key] * scale) for s in samples if isinstance(s.get(key), (int, float))]


def charts_section(view: dict) -> str:
    """Decode tok/s, cache hit rate, bytes read per token and memory over time."""
    samples = view["samples"]
    tok = _points(samples, "decode_tok_s")
    hit = _points(samples, "hit_rate")
    mib = _points(samples, "bytes_per_token", 1 / 2**20)
    rss = _points(samples, "rss_bytes", 1 / 2**30)
    budget = _points(samples, "budget_bytes", 1 / 2**30)
    resident = _points(samples, "resident_bytes", 1 / 2**30)
    ref = {"show_dots": False, "stroke_style": {"dasharray": "6, 4", "width": 2}}
    memory_caption = _describe(rss, " GiB", lambda v: f"{v:.2f}")
    if budget:
        memory_caption += (f" Expert cache budget {budget[-1][1]:.2f} GiB (dashed line), "
                           f"expert slots allocated {resident[-1][1]:.2f} GiB (dotted line).")
    figures = [
        _chart("Decode speed", "tok/s", [("decode tok/s", tok, {})],
               "Recent decode rate of the batch when each document finished. " + _describe(tok, " tok/s"), "tok-s"),
        _chart("Expert cache hit rate", "hit rate", [("hit rate", hit, {})],
               "Experts found resident / experts needed, since the previous document. "
               + _describe(hit, "", percent_text, SHARED), "hit-rate", percent=True),
        _chart("Read from disk per token", "MiB / token", [("MiB read per token", mib, {})],
               "Expert bytes read from disk / tokens generated, since the previous document. "
               + _describe(mib, " MiB", per=SHARED), "bytes-per-token"),
        _chart("Memory", "GiB", [("process RSS", rss, {}), ("cache budget", budget, ref),
                                 ("slots allocated", resident,
                                  {**ref, "stroke_style": {"dasharray": "2, 3", "width": 2}})],
               "Process resident memory when each document finished. " + memory_caption, "memory"),
        thermal_chart(view),
        throttle_time_chart(view),
    ]
    return f'<section id="charts"><h2>Over time</h2><div class="charts">{"".join(figures)}</div></section>'


def thermal_chart(view: dict) -> str:
    """Throttle duty (100% = full speed, 0% = paused) at each state change, and its table."""
    events = view["thermal"]
    duty = [(e["time"], float(e.get("duty", 0.0))) for e in events if isinstance(e.get("time"), (int, float))]
    t = view["throttle"]
    account = ", ".join(f"{name} {fmt_seconds(t[key])}" for key, name in
                        (("throttled_seconds", "slowed"), ("paused_seconds", "paused"), ("capped_seconds", "capped"))
                        if isinstance(t.get(key), (int, float)))
    changes = "1 throttle state change" if len(duty) == 1 else f"{len(duty)} throttle state changes"
    caption = (f"{changes}. " if duty else "No throttle state change recorded: full speed. ")
    caption += f"Time {account} (last finished run)." if account else ""
    figure = _chart("Thermal throttle", "duty", [("duty", duty, {})], caption, "thermal", percent=True)
    if not events:
        return figure
    rows = "".join(
        f'<tr><td class="name">{_e(_clock(e.get("time")))}</td><td class="name">{_e(e.get("thermal"))}</td>'
        f'<td class="name">{_e(e.get("mode"))}</td><td>{_e(e.get("duty"))}</td>'
        f'<td class="name">{_e(e.get("reason"))}</td></tr>' for e in events[-50:])
    table = ('<details id="thermal-table"><summary>Throttle state changes (latest 50)</summary><div class="scroll">'
             '<table><tr><th class="name">time</th><th class="name">thermal</th><th class="name">mode</th>'
             f'<th>duty</th><th class="name">reason</th></tr>{rows}</table></div></details>')
    return figure.replace("</figcaption></figure>", f"</figcaption>{table}</figure>")


def throttle_time_chart(view: dict) -> str:
    """Time throttled, paused or capped, cumulative over the job, at each finished document."""
    points = [(p["time"], p["seconds"]) for p in view["throttle_time"]]
    return _chart("Time throttled or paused", "seconds", [("throttled, paused or capped", points, {})],
                  "Seconds the throttle slowed, paused or capped decoding, summed over the job. "
                  + _describe(points, " s"), "throttle-time")


def _clock(t) -> str:
    return dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S") if isinstance(t, (int, float)) else "?"


def experts_section(view: dict) -> str:
    """Expert use per MoE layer (report.json, summed over runs) as a table: layer × expert, % of the layer's uses."""
    use = view["expert_use"]
    if not use:
        return ('<section id="experts"><h2>Expert use per layer</h2><p class="note">Written to report.json when a '
                'run ends; none yet. Hit rate per layer is not recorded.</p></section>')
    head = "".join(f"<th>e{j}</th>" for j in range(len(use[0])))
    rows = []
    for i, row in enumerate(use):
        total, top = sum(row) or 1, max(row) or 1
        cells = "".join(
            f'<td title="{n} uses" style="background:rgba(31,119,180,{0.7 * n / top:.2f})">'
            f"{n / total:.0%}</td>" for n in row)
        rows.append(f'<tr><th class="name">layer {i}</th>{cells}</tr>')
    return ('<section id="experts"><h2>Expert use per layer</h2><p class="note">Share of each MoE layer\'s routed '
            'tokens that went to each expert, over all finished runs (darker = more; the number is the share). '
            'Hit rate per layer is not recorded.</p>'
            f'<div class="scroll"><table id="expert-use"><tr><th class="name">layer</th>{head}</tr>'
            f'{"".join(rows)}</table></div></section>')


def _noun(view: dict) -> str:
    """What the job's items are: ``"document"``, or ``"request"`` (a batch request file's)."""
    return view["status"].get("noun") or "document"


def failures_section(view: dict) -> str:
    """Failed documents with their errors, and the exact command that retries them."""
    failed = [d for d in view["documents"] if d["status"] == "failed"]
    title = f"Failed {_noun(view)}s"
    if not failed:
        return f'<section id="failures"><h2>{title}</h2><p>None.</p></section>'
    items = "".join(f'<li><strong>{_e(d["source"])}</strong>: <code>{_e(d["error"] or "")}</code></li>'
                    for d in failed)
    return (f'<section id="failures"><h2>{title} ({len(failed)})</h2><ul>{items}</ul>'
            f'<p>Retry only these with:</p><pre id="retry-command">{_e(view["retry_command"])}</pre></section>')


def documents_section(view: dict) -> str:
    """Each document beside its summary (``<details>``, open to read in place); which model
    and prompt wrote it when the job's summaries are a mix."""
    written = view.get("written_by") or []
    items, mixed, noun = [], len(written) > 1, _noun(view)
    requests = noun == "request"  # a request's own max_tokens cut it; its answer is a line of output.jsonl
    for i, d in enumerate(view["documents"]):
        facts = [_MARK[d["status"]]]
        if d["output_tokens"] is not None:
            facts.append(tokens_text(d["output_tokens"]))
        if isinstance(d["seconds"], (int, float)):
            facts.append(fmt_seconds(d["seconds"]))
        if d["finish_reason"] == "length":
            facts.append("cut at its max_tokens" if requests else "cut at --max-tokens")
        if mixed and d["status"] == "done":
            facts.append(_writer(d, written))
        if d["redo"] == "stale" and d["status"] == "done":
            facts.append(f"redone: its {noun} changed")
        missing = ("its answer is not in output.jsonl" if d["status"] == "done" else "not answered yet") \
            if requests else "not summarised yet"
        body = (f'<pre class="summary">{_e(d["summary"])}</pre>' if d["summary"] is not None
                else f'<p class="note">{_e(d["error"] or missing)}</p>')
        items.append(f'<details id="doc-{i}" class="doc"><summary><strong>{_e(d["source"])}</strong> '
                     f'<span class="{d["status"]}">{_e(" · ".join(facts))}</span></summary>{body}</details>')
    title = "Requests and answers" if requests else "Documents and summaries"
    return f'<section id="documents"><h2>{title}</h2>{"".join(items)}</section>'


def _writer(d: dict, written: list[dict]) -> str:
    """``"by demo [3f2a9c1d], prompt 9c1d20aa"``: what wrote a document's summary (a
    ``written_by`` group's or a document's), with the options that differ among the
    job's groups ``written`` (:func:`mlx_tier.outdir.journal.options_apart`)."""
    if d.get("model") is None and d.get("prompt") is None:
        return "by an earlier version (not recorded)"
    weights = f" [{short_fingerprint(d['weights'])}]" if d.get("weights") else ""
    apart = options_apart(written, d.get("options"))
    return f"by {d.get('model') or '?'}{weights}, prompt {(d.get('prompt') or '?')[:8]}{', ' + apart if apart else ''}"


def written_section(view: dict) -> str:
    """The models and prompts the job's summaries were written with, when more than one."""
    written = view.get("written_by") or []
    if len(written) < 2:
        return ""
    prompts = view.get("prompts") or {}
    rows = "".join(
        f'<tr><td>{w["documents"]}</td><td class="name">{_e(_writer(w, written))}</td>'
        f'<td class="name">{_e(prompts.get(w.get("prompt") or "", ""))}</td></tr>' for w in written)
    return ('<section id="written-by"><h2>Written with more than one model, prompt or option</h2><p class="note">'
            'Summaries kept from earlier runs with other settings; <code>--redo-changed</code> rewrites them '
            'with this run\'s.</p><div class="scroll"><table><tr><th>documents</th><th class="name">model, '
            f'prompt</th><th class="name">instruction</th></tr>{rows}</table></div></section>')


def shown(text: str) -> str:
    """``text`` with every lone surrogate written out, so that it encodes as UTF-8.

    A file name that is not valid UTF-8 (``caf\\xe9 menu.txt`` from a Latin-1
    disk) reaches Python as lone surrogates (PEP 383, ``surrogateescape``); on
    the page it shows as ``caf\\xe9 menu.txt``, the way Python prints it.
    """
    return _SURROGATE.sub(lambda m: f"\\x{ord(m.group()) - 0xDC00:02x}" if ord(m.group()) >= 0xDC80
                          else "\ufffd", text)


_SURROGATE = re.compile("[\ud800-\udfff]")


def render_body(view: dict) -> str:
    """The page's ``<main>`` content (the live page swaps this in on each change),
    valid UTF-8 whatever the file names (:func:`shown`)."""
    return shown("".join((numbers_section(view), charts_section(view), experts_section(view),
                          failures_section(view), written_section(view), documents_section(view))))


def render_page(view: dict, live: dict | None = None) -> str:
    """A complete HTML document.

    Args:
        view: :func:`mlx_tier.monitor.view.build_view`'s dict.
        live: ``{"interval_ms": int, "version": str}`` for the watch server's
            page (it polls ``api/state``); ``None`` for the static report.
    """
    title = f"mlx-tier: {Path(view['out_dir']).name or view['out_dir']}"
    made = dt.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    line = "live: updates itself" if live else f"report written {made}; reload after a run to update"
    script = "" if live is None else f"<script>{_POLL % (json.dumps(live['version']), int(live['interval_ms']))}</script>"
    return shown(
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP_LIVE if live else _CSP}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1"><link rel="icon" href="data:,">'
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>"
        f'<header><h1>{_e(title)}</h1><p class="note"><code>{_e(view["out_dir"])}</code> · '
        f'<span id="updated">{_e(line)}</span></p></header>'
        f'<main id="main">{render_body(view)}</main>{script}</body></html>'
    )


# The live page: ask api/state every interval; swap <main> when the version
# changed, keeping the open <details> open.
_POLL = """(function(){var version=%s,every=%d,note=document.getElementById('updated');
function poll(){fetch('api/state?since='+encodeURIComponent(version),{cache:'no-store'})
.then(function(r){return r.json();}).then(function(j){
note.textContent='live: checked '+new Date().toLocaleTimeString();
if(j.version!==version){var open=[].map.call(document.querySelectorAll('details[open]'),function(d){return d.id;});
document.getElementById('main').innerHTML=j.html;open.forEach(function(id){var d=document.getElementById(id);if(d){d.open=true;}});
version=j.version;}}).catch(function(){note.textContent='live: server not reachable, retrying';})
.then(function(){setTimeout(poll,every);});}
setTimeout(poll,every);})();"""


def write_report_html(out_dir: Path) -> Path:
    """Write the static page to ``OUT_DIR/report.html`` (atomically) and return its path.

    Raises:
        InputError: ``out_dir`` is not an mlx-tier output folder.
        OSError: not writable, disk full.
    """
    path = Path(out_dir) / REPORT_HTML
    write_atomic(path, render_page(build_view(out_dir)))
    return path
