"""mlx-tier against its peers: same checkpoint, prompt, tokens and memory cap.

Question: a user who would otherwise run plain mlx-lm,
nunspark (an MLX expert-streaming engine) or llama.cpp -- how does mlx-tier
compare, on the same MoE model, under the same memory cap?

How:
- Engines (``benches/peers_engines.py`` says exactly what each runs):
  mlx-tier; plain mlx-lm (fully resident, float32); nunspark (``nunspark
  pack`` once, then what ``nunspark generate --budget`` runs); llama.cpp
  through ``llama-cpp-python`` on a Q4_0 GGUF of the same shapes
  (``benches/peers_gguf.py``), with and without weight repacking. Peers not
  installed are skipped with a line saying how to install them (``pip install
  -e ".[peers]"`` installs all three; they are not dependencies of mlx-tier).
- Each run is a fresh process inside a Linux cgroup v1 memory group of
  ``--cap-gb`` (page cache charged, swap capped too: ``benches/capped.py``'s
  ``MemoryCgroup``); an OOM kill ends only that run and is counted. Without
  cgroup v1 (macOS, cgroup v2 only, not root) runs are uncapped and the
  caliber says so. ``--cap-gb 0``: uncapped on purpose. Under a cap every
  engine's files are evicted from the page cache once before the first run
  of an invocation, so that every page an engine reads is charged to the cap
  (a page stays charged to the group that first read it).
- Same prompt token ids for every engine (the checkpoint's tokenizer), exactly
  ``--tokens`` greedy tokens (no stop at EOS). Runs interleaved: round r runs
  every engine, rotated by r, each cold (the files of every engine evicted
  from the page cache first) then warm (right after, not evicted). In
  warm-only mode each engine gets one untimed priming run first.
- Per run: decode tok/s (tokens after the first / their time), TTFT (prompt in
  -> first token, load excluded), hit rate where the engine counts hits
  (mlx-tier: experts; nunspark: weight pieces), the process's peak RSS, and the
  load: the 1-minute load average at start and end, and the mean number of
  runnable tasks that are not the run's own (``/proc/loadavg``'s running count
  sampled each second, minus the worker's runnable threads and the sampler).
- Load guard ("the same pair went from 1.5x to 0.8x over three rounds
  while other jobs finished"): when the others' load (the 1-minute average
  where runnable counts are unavailable) moved by more than ``--load-tolerance``
  across the headline runs (those with a rate or a bound on one: a run
  OOM-killed while loading enters no ratio), no headline ratio is printed,
  and the line says by how much it moved. The table (medians, ratios) is
  printed either way.
- ``--caliber seed``: the seeds' acceptance caliber: 9 runs, greedy, 256
  tokens, single request, warm.
- Resumable (``benches/peers_runs.py``): every finished run is appended at
  once to ``OUT/runs.jsonl``; the same command with the same ``--out``
  skips the runs recorded and continues the interleaved order (another
  command's fingerprint -- checkpoint, prompt, tokens, cap, caliber,
  engines, limit -- is refused, exit 2); Ctrl-C loses only the run in
  flight. The table comes from the file: ``--report-only --out OUT``.
- ``--run-limit-s``: a run still going at the limit (load included) is
  stopped and recorded as a bound (``<x`` tok/s), never as completed; an
  engine OOM-killed or over the limit in its first run is not run again.
  The plan's wall time (at most runs x limit) is printed up front, and a
  progress line (run k of n, phase, tokens, elapsed) while it runs.

    python benches/peers.py --model DIR --cap-gb 2 --caliber seed --out DIR2
    python benches/peers.py --report-only --out DIR2

Defaults: the synthetic 2 GiB qwen3_moe of ``make_synthetic_moe.py``, 2 GiB
cap, 3 runs, 32 tokens, 32-token prompt, cold and warm, 900 s per run (2400
with ``--caliber seed``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

GIB = 1024**3
HERE = Path(__file__).resolve().parent
ENGINES = ("mlx-tier", "mlx-lm", "nunspark", "llama.cpp", "llama.cpp repack")
# module needed -> how to install it; checked per engine before anything runs
NEEDS = {
    "nunspark": (("nunspark",), "pip install nunspark"),
    "llama.cpp": (("llama_cpp", "gguf"), "pip install llama-cpp-python gguf; a ~10-minute C++ build"),
}
NEEDS["llama.cpp repack"] = NEEDS["llama.cpp"]
CALIBERS = {"seed": {"runs": 9, "tokens": 256, "temps": ("warm",)}}
# per-run limit, s, by caliber. Seed, 256 tokens under the 2 GiB cap (benches/results/peers-seed/NOTES.md, 16-token runs scaled): mlx-tier
# ~3.5 min, nunspark ~24 min (0.2 tok/s + 2 min TTFT; 40 min still lets it finish at 0.13 tok/s on a busier
# machine), llama.cpp with mmap ~1 h at 0.07 tok/s (stopped in its first run, then dropped)
RUN_LIMIT_S = {"seed": 2400, None: 900}
WIDTH = 80


# ------------------------------------------------------------------ pure logic
def install_hint(engine: str, has_module=lambda m: importlib.util.find_spec(m) is not None) -> str | None:
    """``None`` when ``engine`` can run here, else the line saying how to install it."""
    modules, how = NEEDS.get(engine, ((), ""))
    missing = [m for m in modules if not has_module(m)]
    if not missing:
        return None
    return f"{engine}: skipped, {', '.join(missing)} not installed: {how}; or pip install -e \".[peers]\""


def load_guard(loads: list[float], tolerance: float) -> tuple[bool, float]:
    """Whether a headline ratio may be printed: ``(ok, spread)``.

    Args:
        loads: one load figure per headline run (others' runnable tasks, or
            the 1-minute load average).
        tolerance: the largest spread (max - min) that still allows it.

    Returns:
        ``(spread <= tolerance, spread)``; no runs: ``(False, 0.0)``.
    """
    if not loads:
        return False, 0.0
    spread = max(loads) - min(loads)
    return spread <= tolerance, spread


def has_rate(run: dict) -> bool:
    """Whether a run gives a decode rate or a bound on one: only those enter a ratio, and the load guard."""
    return run.get("tok_s") is not None or run.get("tok_s_below") is not None


def run_load(run: dict) -> float | None:
    """The load figure the guard uses for one run: others' runnable tasks, else the 1-minute average."""
    if run.get("others") is not None:
        return run["others"]
    starts = [run[k] for k in ("load1_start", "load1_end") if run.get(k) is not None]
    return statistics.fmean(starts) if starts else None


def summarise(runs: list[dict], dropped_why: str | None = None) -> dict:
    """Medians over completed runs, and what became of the others.

    Args:
        runs: per-run dicts with ``outcome`` (``"ok"``, ``"OOM-killed ..."``,
            ``"over the N s limit ..."``, ``"failed ..."``) and, when
            measured, ``tok_s``, ``ttft``, ``hit_rate``, ``peak_rss`` (bytes);
            a run stopped at the limit may carry ``tok_s_below`` (its decode
            rate was under this) and ``rate_so_far``.
        dropped_why: why the engine was not run again after its first run
            (``peers_runs.dropped``), if it was not.

    Returns:
        ``runs``, ``ok``, ``oom``, ``over``, ``failed`` counts; medians of the
        measured keys over completed runs; when no run completed,
        ``tok_s_below`` (the largest bound: every stopped run was slower) and
        ``rate_so_far`` (median); ``dropped``.
    """
    ok = [r for r in runs if r["outcome"] == "ok"]
    s = {"runs": len(runs), "ok": len(ok),
         "oom": sum(r["outcome"].startswith("OOM") for r in runs),
         "over": sum(r["outcome"].startswith("over") for r in runs), "dropped": dropped_why}
    s["failed"] = s["runs"] - s["ok"] - s["oom"] - s["over"]
    for key in ("tok_s", "ttft", "hit_rate", "peak_rss", "load_s"):
        vals = [r[key] for r in ok if r.get(key) is not None]
        if vals:
            s[key] = statistics.median(vals)
    if not ok:
        below = [r["tok_s_below"] for r in runs if r.get("tok_s_below") is not None]
        so_far = [r["rate_so_far"] for r in runs if r.get("rate_so_far") is not None]
        if below:
            s["tok_s_below"] = max(below)
        if so_far:
            s["rate_so_far"] = statistics.median(so_far)
    return s


def outcome_cell(s: dict) -> str:
    """``9/9`` when all completed, else ``done/runs``, what happened to the rest, and ``dropped``."""
    cell = f"{s['ok']}/{s['runs']}"
    rest = [f"{s[k]} {label}" for k, label in (("oom", "OOM"), ("over", "over"), ("failed", "failed")) if s[k]]
    return cell + (" " + ", ".join(rest) if rest else "") + (", dropped" if s.get("dropped") else "")


def _cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def speed_cells(s: dict, tier: float | None) -> tuple[str, str]:
    """The tok/s and ratio-to-mlx-tier cells: ``2.00``/``1.00x``; ``<0.15``/``<0.08x`` for a bound only."""
    def num(v: float) -> str:  # 3-4 significant digits, at most 6 characters up to 9999
        return f"{v:.2f}" if v < 100 else f"{v:.0f}"

    if "tok_s" in s:
        return num(s["tok_s"]), f"{num(s['tok_s'] / tier)}x" if tier else "-"
    if "tok_s_below" in s:
        return f"<{num(s['tok_s_below'])}", f"<{num(s['tok_s_below'] / tier)}x" if tier else "-"
    return "-", "-"


def table(summary: dict[tuple[str, str], dict]) -> list[str]:
    """The results table, one line per (engine, temperature), each at most ``WIDTH`` characters.

    Args:
        summary: ``{(engine, "cold"|"warm"): summarise(...)}`` in print order.

    Returns:
        Header, rule and rows: decode tok/s (``<x``: every run was stopped at
        the limit, so only a bound), TTFT s, hit rate, peak RSS GiB, completed
        / runs with OOM kills, runs over the limit and ``dropped``, and tok/s
        as a ratio to mlx-tier's (same temperature).
    """
    head = (f"{'engine':<16} {'run':<4} {'tok/s':>6} {'TTFT s':>6} {'hit':>4} {'RSS GiB':>7}  "
            f"{'completed':<22} {'vs tier':>7}")
    lines = [head, "-" * len(head)]
    for (engine, temp), s in summary.items():
        speed, ratio = speed_cells(s, summary.get(("mlx-tier", temp), {}).get("tok_s"))
        rss = s["peak_rss"] / GIB if "peak_rss" in s else None
        lines.append(f"{engine[:16]:<16} {temp:<4} {speed:>6} {_cell(s.get('ttft'), '.1f'):>6} "
                     f"{_cell(s.get('hit_rate'), '.0%'):>4} {_cell(rss, '.2f'):>7}  {outcome_cell(s)[:22]:<22} "
                     f"{ratio:>7}")
    return lines


def headline(summary: dict[tuple[str, str], dict], temp: str, loads: list[float], tolerance: float,
             what: str) -> str:
    """The headline line: peers' tok/s ratios to mlx-tier at ``temp``, or why there is none."""
    ok, spread = load_guard(loads, tolerance)
    if not ok:
        if not loads:
            return "no headline ratio: no load recorded"
        return (f"no headline ratio: the load moved by {spread:.2f} ({what} {min(loads):.2f}-{max(loads):.2f} "
                f"across the {temp} runs; tolerance {tolerance:.2f}). Rerun on a quiet machine.")
    tier = summary.get(("mlx-tier", temp), {}).get("tok_s")
    if not tier:
        return "no headline ratio: mlx-tier completed no run"
    parts = []
    for (e, t), s in summary.items():
        if t != temp or e == "mlx-tier":
            continue
        _, ratio = speed_cells(s, tier)
        if "tok_s" in s:
            parts.append(f"{e} {ratio}")
        elif "tok_s_below" in s:
            parts.append(f"{e} {ratio} (stopped at the limit, a bound)")
        else:
            parts.append(f"{e} {outcome_cell(s)}")
    return (f"headline ({temp}, load moved {spread:.2f} <= {tolerance:.2f}): mlx-tier {tier:.2f} tok/s"
            + "".join(f"; {p}" for p in parts))


def wrap(text: str, indent: str = "  ") -> list[str]:
    """``text`` broken into lines of at most ``WIDTH`` characters."""
    import textwrap

    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ")


# --------------------------------------------------------------- load sampling
def _runnable_threads(pid: int) -> int:
    n = 0
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        with contextlib.suppress(OSError):
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "R":
                n += 1
    return n


class LoadSampler:
    """Each second while a run lasts: runnable tasks on the machine that are not the run's own.

    Linux only (``/proc/loadavg``'s running count); elsewhere ``mean()`` is ``None``.
    """

    def __init__(self, pid: int):
        self.pid, self.samples, self._stop = pid, [], threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            try:
                running = int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
            except (OSError, ValueError, IndexError):
                return
            own = _runnable_threads(self.pid) + 1  # + this sampler, running while it reads
            self.samples.append(max(running - own, 0))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def mean(self) -> float | None:
        return statistics.fmean(self.samples) if self.samples else None


# ----------------------------------------------------------------- preparation
@dataclass(frozen=True)
class Prepared:
    """Files each engine reads, derived once from the checkpoint (under ``--work``)."""

    model: Path
    packed: Path | None = None  # nunspark
    gguf: Path | None = None  # llama.cpp

    def files(self) -> list[Path]:
        """Every file an engine reads, to evict for cold runs."""
        out = sorted(self.model.glob("*.safetensors"))
        if self.packed is not None:
            out += sorted(self.packed.glob("*.safetensors"))
        if self.gguf is not None:
            out.append(self.gguf)
        return out


def pack_nunspark(model: Path, out: Path, log=print) -> Path:
    """``nunspark pack MODEL OUT`` once; the routers marked unquantised in its manifest.

    The synthetic checkpoint keeps its routers (``mlp.gate``) in bfloat16, as
    mlx-lm's own recipes do, and says so only by giving them no ``scales``:
    mlx-lm reads that, nunspark quantises every linear layer its config names
    unless a per-path ``false`` entry says otherwise, so those entries are added
    to the packed manifest's quantization config.
    """
    manifest = out / "manifest.json"
    if not manifest.is_file():
        log(f"nunspark pack {model} {out} (once)")
        exe = Path(sys.executable).with_name("nunspark")
        subprocess.run([str(exe), "pack", str(model), str(out)], check=True, stdout=subprocess.DEVNULL)
    m = json.loads(manifest.read_text())
    quant = m["config"].get("quantization")
    if quant is not None:
        for i in range(m["num_layers"]):
            quant.setdefault(f"model.layers.{i}.mlp.gate", False)
        manifest.write_text(json.dumps(m, indent=1))
    return out


def prepare(model: Path, engines: list[str], work: Path, log=print) -> Prepared:
    """Pack for nunspark and write the GGUF when those engines run (kept in ``work`` for later runs)."""
    tag = f"{model.name}-{hashlib.sha1(str(model).encode()).hexdigest()[:8]}"
    work.mkdir(parents=True, exist_ok=True)
    packed = gguf = None
    if "nunspark" in engines:
        packed = pack_nunspark(model, work / f"{tag}.nunspark", log)
    if any(e.startswith("llama.cpp") for e in engines):
        gguf = work / f"{tag}.q4_0.gguf"
        if not gguf.is_file():
            from peers_gguf import write_gguf

            log(f"writing {gguf} (once)")
            write_gguf(model, gguf, progress=log)
    return Prepared(model, packed, gguf)


# --------------------------------------------------------------------- one run
def _events(stdout: str) -> list[dict]:
    out = []
    for line in stdout.splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return out


def _outcome(events: list[dict], stopped: bool, oom: int, stderr: str, code: int, limit: int) -> str:
    phase = events[-1]["phase"] if events else "starting"
    if events and phase == "done":
        return "ok"
    if stopped:
        return f"over the {limit} s limit while {'generating' if phase == 'progress' else phase}"
    if oom:
        return f"OOM-killed while {'generating' if phase == 'progress' else phase}"
    tail = stderr.strip().splitlines()[-1:] or [f"exit code {code}"]
    return f"failed while {phase}: {tail[0][:160]}"


def run_once(spec, cgroup, limit_s: int, tick=lambda elapsed, event: None) -> dict:
    """One run of ``spec`` (a ``peers_engines.RunSpec``) in a fresh process, inside ``cgroup`` when given.

    Stopped after ``limit_s`` seconds (load included); such a run keeps
    ``peers_runs.bound_fields``. ``tick(elapsed_s, last_event)`` about once a
    second. Returns the run's record: ``outcome``, ``wall_s``, load figures,
    the worker's result when it completed.
    """
    from peers_runs import bound_fields, watch

    cmd = [sys.executable, str(HERE / "peers_engines.py"), json.dumps(dataclasses.asdict(spec))]
    oom_before = 0
    if cgroup is not None:
        cgroup.reset_peak()
        oom_before = cgroup.oom_kills()
        cmd = cgroup.wrap(cmd)
    run = {"engine": spec.engine, "load1_start": os.getloadavg()[0]}
    samplers = []

    def on_start(pid: int) -> None:
        samplers.append(LoadSampler(pid).__enter__())

    try:
        w, code = watch(cmd, limit_s, tick, cwd=HERE, on_start=on_start)
    finally:
        for sampler in samplers:
            sampler.__exit__(None, None, None)
    run.update(load1_end=os.getloadavg()[0], others=samplers[0].mean(), returncode=code, wall_s=w.wall_s)
    oom = cgroup.oom_kills() - oom_before if cgroup is not None else 0
    run["outcome"] = _outcome(w.events, w.stopped, oom, w.stderr, code, limit_s)
    if cgroup is not None:
        run["cgroup_peak"] = cgroup.read("memory.max_usage_in_bytes")
    if run["outcome"] == "ok":
        run.update(w.events[-1]["result"])
    elif w.stopped:
        run.update(bound_fields(w, spec.max_tokens))
    return run


# ------------------------------------------------------------------ the bench
def make_specs(engines: list[str], prep: Prepared, prompt: list[int], tokens: int, cache_gb: float,
               budget_bytes: int, kernel: str) -> dict[str, object]:
    """One ``RunSpec`` per engine, all with the same prompt and token count."""
    from peers_engines import RunSpec

    return {e: RunSpec(engine=e, model=str(prep.model), prompt=tuple(prompt), max_tokens=tokens, cache_gb=cache_gb,
                       tier_kernel=kernel, packed=str(prep.packed or ""), budget_bytes=budget_bytes,
                       gguf=str(prep.gguf or ""), threads=psutil.cpu_count() or 1)
            for e in engines}


def run_line(slot, total: int, run: dict) -> str:
    """One finished run, for the log: ``run 3/45 nunspark warm: ok, 0.20 tok/s``."""
    speed = (f", {run['tok_s']:.2f} tok/s" if "tok_s" in run else
             f", <{run['tok_s_below']:.2f} tok/s" if run.get("tok_s_below") is not None else "")
    return f"run {slot.index + 1}/{total} {slot.engine} {slot.temp}: {run['outcome'][:48]}{speed}"


def run_plan(specs: dict, plan: list, out: Path, files: list[Path], cgroup, limit_s: int, temps, runner=run_once,
             drop_pages=None) -> list[dict]:
    """Run the slots of ``plan`` not yet recorded in ``out``, appending each finished run there at once.

    Engines dropped (``peers_runs.dropped``) are skipped, also when dropped
    during this call. Under a cap, ``files`` are first evicted from the page
    cache: a page stays charged to the cgroup that first read it, so pages
    cached before the cap (the GGUF just written, a previous invocation's
    cgroup) would be outside it -- measured: llama.cpp's mmap reached a peak
    RSS of 3.4-4.9 GiB under the 2 GiB cap before this. Warm-only: each
    engine still to run gets one untimed priming run first (16 tokens, not
    recorded). Ctrl-C (KeyboardInterrupt) passes through; only the run in
    flight is lost. Returns every recorded run.
    """
    from peers_runs import Progress, append_run, dropped, load_runs, pending

    recorded = load_runs(out)
    todo = pending(plan, recorded)
    progress = Progress()
    if todo and cgroup is not None:  # pages cached before the cap (a file written, an earlier pass) are
        (drop_pages or _drop_pages)(files)  # charged outside it: evict, so every page read now counts
    if temps == ("warm",):  # warm-only: prime the page cache once per engine, untimed
        for e in dict.fromkeys(s.engine for s in todo):
            progress.start(f"priming {e}")
            short = dataclasses.replace(specs[e], max_tokens=min(specs[e].max_tokens, 16))
            progress.line(f"priming {e}: {runner(short, cgroup, limit_s, progress.tick)['outcome'][:60]}")
    for slot in todo:
        if slot.engine in dropped(recorded):
            continue
        if slot.temp == "cold":
            (drop_pages or _drop_pages)(files)
        progress.start(f"run {slot.index + 1}/{len(plan)} {slot.engine} {slot.temp}")
        run = runner(specs[slot.engine], cgroup, limit_s, progress.tick)
        run.update(slot=slot.index, round=slot.round, temp=slot.temp, engine=slot.engine)
        append_run(out, run)
        recorded.append(run)
        progress.line(run_line(slot, len(plan), run))
        why = dropped(recorded).get(slot.engine)
        if why and sum(r["engine"] == slot.engine for r in recorded) == 1:
            progress.line(f"  {slot.engine}: {why} in its first run, not run again")
    return recorded


def _drop_pages(files: list[Path]) -> None:
    from pagecache import drop_pages

    drop_pages(files)


def prompt_ids(model: Path, n: int) -> list[int]:
    """The first ``n`` token ids of a fixed English text (repeated if short), the checkpoint's tokenizer."""
    from capped import TEXT
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    ids = load_tokenizer(model).encode(TEXT)
    return (ids * (n // len(ids) + 1))[:n]


def model_meta(model: Path) -> dict:
    """What the caliber header says of the checkpoint (kept in ``plan.json`` for ``--report-only``)."""
    cfg = json.loads((model / "config.json").read_text())
    return {"name": model.name, "model_type": cfg["model_type"], "layers": cfg["num_hidden_layers"],
            "experts": cfg.get("num_experts", "?"), "top_k": cfg.get("num_experts_per_tok", "?"),
            "bytes": sum(f.stat().st_size for f in model.glob("*.safetensors"))}


def machine_line() -> str:
    from mlx_tier.job.report import backend_name

    return (f"{platform.machine()} {platform.system()}, {psutil.cpu_count()} cores, "
            f"{psutil.virtual_memory().total / GIB:.0f} GiB, MLX {backend_name()}")


def caliber_lines(fp: dict, meta: dict, runs: dict) -> list[str]:
    """The header: machine, cap, model, prompt, tokens, runs, limit, load.

    Args:
        fp: the command's fingerprint (``fingerprint``).
        meta: ``machine`` (``machine_line()``) and ``model`` (``model_meta``).
        runs: ``{(engine, temp): [run, ...]}`` recorded.
    """
    m = meta["model"]
    all_runs = [r for rs in runs.values() for r in rs]
    l1 = [r[k] for r in all_runs for k in ("load1_start", "load1_end") if r.get(k) is not None]
    others = [r["others"] for r in all_runs if r.get("others") is not None]
    cap = f"{fp['cap_gb']:g} GiB cgroup v1 (page cache charged)" if fp["capped"] else "NONE (runs uncapped)"
    lines = [
        f"machine: {meta['machine']}; cap: {cap}",
        f"model: {m['name']}, {m['model_type']}, {m['bytes'] / GIB:.2f} GiB"
        + (f" = {m['bytes'] / (fp['cap_gb'] * GIB):.1f}x the cap" if fp["cap_gb"] else "")
        + f"; {m['layers']} layers x {m['experts']} experts, top-{m['top_k']}",
        f"single request, prompt {fp['prompt_tokens']} tokens, {fp['tokens']} greedy tokens; {fp['runs']} "
        f"run{'s' if fp['runs'] > 1 else ''} x {'+'.join(fp['temps'])}, interleaved, medians; each run stopped "
        f"at {fp['run_limit_s']} s; mlx-tier cache {fp['cache_gb']:g} GiB (kernel {fp['tier_kernel']}); "
        f"nunspark budget {fp['budget_bytes'] / 1e9:.2f} GB",
        f"load average (1 min) {min(l1, default=0):.1f}-{max(l1, default=0):.1f}; others' runnable tasks "
        + (f"{min(others):.1f}-{max(others):.1f} (run means)" if others else "not sampled"),
    ]
    return [w for line in lines for w in wrap(line)]


def token_agreement(runs: dict) -> str:
    """Which engines' greedy tokens equal mlx-tier's (first completed run of each)."""
    first = {}
    for (e, _), rs in runs.items():
        for r in rs:
            if "token_ids" in r and e not in first:
                first[e] = r["token_ids"]
    ref = first.get("mlx-tier")
    if ref is None:
        return "tokens: no mlx-tier run completed"
    same = [f"{e} {'same' if t == ref else 'differ'}" for e, t in first.items() if e != "mlx-tier"]
    return "greedy tokens vs mlx-tier: " + (", ".join(same) or "no other engine completed")


def dense_bytes(model: Path) -> int:
    """Bytes of the checkpoint's tensors outside the experts (``switch_mlp``), from the safetensors headers."""
    total = 0
    for f in model.glob("*.safetensors"):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()
                     if k != "__metadata__" and "switch_mlp" not in k)
    return total


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="mlx-lm MoE checkpoint (default: the synthetic 2 GiB)")
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma list of: " + ", ".join(ENGINES))
    ap.add_argument("--caliber", choices=sorted(CALIBERS), default=None,
                    help="seed: 9 runs, 256 greedy tokens, warm (overrides --runs, --tokens, --temps)")
    ap.add_argument("--runs", type=int, default=3, help="rounds; each runs every engine once per temperature")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens generated per run")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--temps", default="cold,warm", help="cold, warm or both (page cache evicted or not)")
    ap.add_argument("--cap-gb", type=float, default=2.0, help="memory cap, GiB, page cache included (0: none)")
    ap.add_argument("--cache-gb", type=float, default=None, help="mlx-tier expert cache, GiB (default 40%% of the cap)")
    ap.add_argument("--budget-gb", type=float, default=None,
                    help="nunspark weight budget, GB (default: mlx-tier's cache + the dense weights)")
    ap.add_argument("--tier-kernel", default="auto", help="mlx-tier expert kernel (TierConfig.kernel)")
    ap.add_argument("--load-tolerance", type=float, default=0.5,
                    help="largest move of the load across headline runs that still allows a headline ratio")
    ap.add_argument("--run-limit-s", type=int, default=None,
                    help=f"seconds a run may take, load included, before it is stopped and recorded as a bound "
                         f"(default {RUN_LIMIT_S['seed']} with --caliber seed, else {RUN_LIMIT_S[None]})")
    ap.add_argument("--out", type=Path, default=None,
                    help="results folder (plan.json, runs.jsonl); the same command with the same --out continues "
                         "a pass (default: a new folder under $MLX_TIER_CACHE/peers-runs)")
    ap.add_argument("--report-only", action="store_true", help="print the table of --out's runs; run nothing")
    ap.add_argument("--work", type=Path, default=None, help="packed and GGUF copies (default: $MLX_TIER_CACHE/peers)")
    args = ap.parse_args(argv)
    if args.caliber:
        c = CALIBERS[args.caliber]
        args.runs, args.tokens, args.temps = c["runs"], c["tokens"], ",".join(c["temps"])
    if args.run_limit_s is None:
        args.run_limit_s = RUN_LIMIT_S[args.caliber]
    args.temps = tuple(t for t in ("cold", "warm") if t in args.temps.split(","))
    return args


def check_args(args) -> str | None:
    """One line saying what is wrong with the arguments, or ``None``."""
    if args.report_only:
        if args.out is None or not (args.out / "plan.json").is_file():
            return f"--report-only needs --out DIR of an earlier run (no plan.json in {args.out})"
        return None
    unknown = [e for e in args.engines.split(",") if e not in ENGINES]
    if unknown:
        return f"unknown engine {unknown[0]!r}; choose from: {', '.join(ENGINES)}"
    if args.model is not None and not (args.model / "config.json").is_file():
        return f"--model {args.model}: no config.json there (an mlx-lm checkpoint directory is expected)"
    if not args.temps:
        return "--temps takes cold, warm or cold,warm"
    if args.runs < 1 or args.tokens < 2 or args.prompt_tokens < 1:
        return "--runs >= 1, --tokens >= 2 and --prompt-tokens >= 1 are needed"
    if args.cap_gb < 0 or (args.cache_gb is not None and args.cache_gb <= 0):
        return "--cap-gb must be >= 0 and --cache-gb > 0"
    if args.run_limit_s < 1:
        return "--run-limit-s must be >= 1"
    return None


def fingerprint(args, model: Path, engines: list[str], prompt: list[int], capped: bool, cache_gb: float,
                budget: int) -> dict:
    """What must stay the same for runs to be pooled in one table: a rerun with another one is refused."""
    cfg = (model / "config.json").read_bytes()
    return {"model": str(model), "model_config_sha1": hashlib.sha1(cfg).hexdigest(),
            "model_bytes": sum(f.stat().st_size for f in model.glob("*.safetensors")),
            "prompt_tokens": len(prompt), "prompt_sha1": hashlib.sha1(json.dumps(prompt).encode()).hexdigest(),
            "tokens": args.tokens, "cap_gb": args.cap_gb, "capped": capped, "caliber": args.caliber,
            "runs": args.runs, "temps": list(args.temps), "engines": engines, "cache_gb": cache_gb,
            "budget_bytes": budget, "tier_kernel": args.tier_kernel, "run_limit_s": args.run_limit_s}


def plan_lines(fp: dict, plan: list, recorded: list[dict]) -> list[str]:
    """What is left and how long it may take: runs x the limit at most; expected from the runs so far."""
    from peers_runs import dropped, duration, estimate_s, pending

    todo = pending(plan, recorded)
    expected, at_most = estimate_s(todo, recorded, fp["run_limit_s"])
    priming = len({s.engine for s in todo}) if fp["temps"] == ["warm"] else 0
    gone = dropped(recorded)
    lines = [f"plan: {len(fp['engines'])} engine(s) x {fp['runs']} rounds x {'+'.join(fp['temps'])} = {len(plan)} "
             f"runs of {fp['tokens']} tokens; {len(recorded)} recorded, {len(todo)} to go"
             + (f" ({', '.join(gone)} dropped)" if gone else ""),
             f"time: at most {duration(at_most + priming * fp['run_limit_s'])} ({len(todo)} runs"
             + (f" + {priming} priming" if priming else "") + f" x the {duration(fp['run_limit_s'])} limit); "
             f"expected {duration(expected)} from the runs so far (the limit for engines not yet run), less as "
             f"engines over the limit or OOM-killed in their first run drop out"]
    return [w for line in lines for w in wrap(line, indent="")]


def report(out: Path, tolerance: float) -> None:
    """Print the caliber, table, headline and notes, from ``out``'s files alone."""
    from peers_runs import dropped, load_plan, load_runs, pending

    plan, recorded = load_plan(out), load_runs(out)
    fp, meta = plan["fingerprint"], plan.get("meta")
    gone = dropped(recorded)
    runs: dict[tuple[str, str], list[dict]] = {(e, t): [] for e in fp["engines"] for t in fp["temps"]}
    for r in sorted(recorded, key=lambda r: r["slot"]):
        runs.setdefault((r["engine"], r["temp"]), []).append(r)
    summary = {key: summarise(rs, gone.get(key[0])) for key, rs in runs.items() if rs}
    print()
    if meta:
        print("\n".join(caliber_lines(fp, meta, runs)) + "\n")
    print("\n".join(table(summary)))
    head_temp = "warm" if "warm" in fp["temps"] else fp["temps"][0]
    head_runs = [r for (_, t), rs in runs.items() if t == head_temp for r in rs if has_rate(r)]
    loads = [x for x in map(run_load, head_runs) if x is not None]
    what = "others' runnable tasks" if all(r.get("others") is not None for r in head_runs) else "load average"
    notes = [f"{e}: {why} in its first run, not run again" for e, why in gone.items()]
    if any("tok_s_below" in s for s in summary.values()):
        notes.append(f"<x: every run stopped at the {fp['run_limit_s']} s limit before its {fp['tokens']} tokens, "
                     f"so its decode rate was below x = {fp['tokens'] - 1} tokens / the time from its first token "
                     f"to the stop; a bound, not a completed run")
    notes += [f"{e} {t}: {s['rate_so_far']:.2f} tok/s over the tokens it decoded before the stop"
              for (e, t), s in summary.items() if "rate_so_far" in s]
    print()
    for line in [headline(summary, head_temp, loads, tolerance, what), token_agreement(runs), *notes,
                 *(meta or {}).get("notes", [])]:
        print("\n".join(wrap(line, indent="")))
    todo = pending(slots_of(fp), recorded)
    print("\n".join(wrap(f"results: {out / 'runs.jsonl'}: {len(recorded)} run(s) recorded, "
                         + (f"{len(todo)} to go (the same command with --out continues)" if todo
                            else "the pass is complete"), indent="")))


def slots_of(fp: dict) -> list:
    """The interleaved plan of the command ``fp`` describes."""
    from peers_runs import slots

    return slots(tuple(fp["engines"]), tuple(fp["temps"]), fp["runs"])


def start(args, notes: list[str], stack: contextlib.ExitStack) -> tuple[dict, Path, object, dict, Prepared]:
    """Everything before the first run: ``(fingerprint, out, cgroup or None, RunSpec per engine, Prepared)``.

    Raises:
        peers_runs.Mismatch: ``--out`` holds another command's runs.
    """
    from capped import DEFAULT_CACHE_FRACTION, open_cgroup
    from make_synthetic_moe import ensure_synthetic
    from peers_runs import open_results, save_meta

    from mlx_tier.fsio import user_cache_dir as cache_dir

    engines = []
    for e in args.engines.split(","):
        hint = install_hint(e)
        if hint:
            notes.append(hint)
            print(hint)
        else:
            engines.append(e)
    model = (args.model or ensure_synthetic()).resolve()
    cache_gb = args.cache_gb or round((args.cap_gb or 2.0) * DEFAULT_CACHE_FRACTION, 3)
    budget = int(args.budget_gb * 1e9) if args.budget_gb else int(cache_gb * GIB) + dense_bytes(model)
    prompt = prompt_ids(model, args.prompt_tokens)
    cgroup = open_cgroup(int(args.cap_gb * GIB), notes, stack) if args.cap_gb else None
    if not args.cap_gb:
        notes.append("--cap-gb 0: runs are uncapped on purpose")
    fp = fingerprint(args, model, engines, prompt, cgroup is not None, cache_gb, budget)
    out = args.out or cache_dir() / "peers-runs" / time.strftime("%Y%m%d-%H%M%S")
    recorded = open_results(out, fp)
    save_meta(out, {"machine": machine_line(), "model": model_meta(model), "notes": notes})
    print(f"results: {out} (rerun the same command with --out {out} to continue)")
    for line in plan_lines(fp, slots_of(fp), recorded):
        print(line)
    prep = prepare(model, engines, args.work or cache_dir() / "peers")
    specs = make_specs(engines, prep, prompt, args.tokens, cache_gb, budget, args.tier_kernel)
    return fp, out, cgroup, specs, prep


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill PID``), handled as Ctrl-C but exiting 143 (128 + 15), not 130."""


def _terminate(signum, frame) -> None:
    raise Terminated


def _interrupted(e: KeyboardInterrupt) -> int:
    """The exit code of an interrupted pass: 143 after SIGTERM, 130 after Ctrl-C."""
    return 143 if isinstance(e, Terminated) else 130


def main(argv=None) -> int:
    args = parse_args(argv)
    problem = check_args(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.report_only:
        report(args.out, args.load_tolerance)
        return 0
    before = signal.signal(signal.SIGTERM, _terminate)  # `kill PID` of a nohup'd pass: as Ctrl-C, the worker killed too
    try:
        return _pass(args)
    finally:
        signal.signal(signal.SIGTERM, before)


def _pass(args) -> int:
    """Prepare, run the plan and report (``main`` after the checks): the exit code."""
    from peers_runs import Mismatch

    notes: list[str] = []
    with contextlib.ExitStack() as stack:
        try:
            fp, out, cgroup, specs, prep = start(args, notes, stack)
        except Mismatch as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt as e:  # e.g. while nunspark packs the model: no run started yet
            print("\ninterrupted while preparing: no run was started; the same command starts again",
                  file=sys.stderr)
            return _interrupted(e)
        try:
            run_plan(specs, slots_of(fp), out, prep.files(), cgroup, args.run_limit_s, args.temps)
        except KeyboardInterrupt as e:
            print("\n" + "\n".join(wrap(f"interrupted: the run in flight is lost, the others are in "
                                         f"{out / 'runs.jsonl'}; the same command with --out {out} continues",
                                         indent="")))
            report(out, args.load_tolerance)
            return _interrupted(e)
    report(out, args.load_tolerance)
    return 0


if __name__ == "__main__":
    sys.exit(main())
