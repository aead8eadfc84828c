"""mlx-tier against its peers, side by side: same checkpoint, prompt, tokens and memory cap.

Question (issue 14, section 2): a user who would otherwise run plain mlx-lm,
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
  caliber says so. ``--cap-gb 0``: uncapped on purpose.
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
- Load guard (issue 14: "the same pair went from 1.5x to 0.8x over three rounds
  while other jobs finished"): when the others' load (the 1-minute average
  where runnable counts are unavailable) moved by more than ``--load-tolerance``
  across the headline runs, no headline ratio is printed, and the line says by
  how much it moved. The table (medians, ratios) is printed either way.
- ``--caliber seed``: the seeds' acceptance caliber: 9 runs, greedy, 256
  tokens, single request, warm.

    python benches/peers.py --model DIR --cap-gb 2 --caliber seed

Defaults: the synthetic 2 GiB qwen3_moe of ``make_synthetic_moe.py``, 2 GiB
cap, 3 runs, 32 tokens, 32-token prompt, cold and warm. Results also go to a
JSON file (``--json``; default under ``$MLX_TIER_CACHE``).
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


def run_load(run: dict) -> float | None:
    """The load figure the guard uses for one run: others' runnable tasks, else the 1-minute average."""
    if run.get("others") is not None:
        return run["others"]
    starts = [run[k] for k in ("load1_start", "load1_end") if run.get(k) is not None]
    return statistics.fmean(starts) if starts else None


def summarise(runs: list[dict]) -> dict:
    """Medians over completed runs, and what became of the others.

    Args:
        runs: per-run dicts with ``outcome`` (``"ok"``, ``"OOM-killed ..."``,
            ``"timed out ..."``, ``"failed ..."``) and, when measured,
            ``tok_s``, ``ttft``, ``hit_rate``, ``peak_rss`` (bytes),
            ``partial_tok_s`` (a timed-out run's rate so far).

    Returns:
        ``runs``, ``ok``, ``oom``, ``timeouts``, ``failed`` counts; medians of
        the measured keys over completed runs; ``partial_tok_s`` (median over
        timed-out runs) when no run completed.
    """
    ok = [r for r in runs if r["outcome"] == "ok"]
    s = {"runs": len(runs), "ok": len(ok),
         "oom": sum(r["outcome"].startswith("OOM") for r in runs),
         "timeouts": sum(r["outcome"].startswith("timed out") for r in runs)}
    s["failed"] = s["runs"] - s["ok"] - s["oom"] - s["timeouts"]
    for key in ("tok_s", "ttft", "hit_rate", "peak_rss", "load_s"):
        vals = [r[key] for r in ok if r.get(key) is not None]
        if vals:
            s[key] = statistics.median(vals)
    partial = [r["partial_tok_s"] for r in runs if r.get("partial_tok_s") is not None]
    if not ok and partial:
        s["partial_tok_s"] = statistics.median(partial)
    return s


def outcome_cell(s: dict) -> str:
    """``9/9`` when all completed, else ``done/runs`` plus what happened to the rest."""
    cell = f"{s['ok']}/{s['runs']}"
    rest = [f"{s[k]} {label}" for k, label in (("oom", "OOM"), ("timeouts", "timeout"), ("failed", "failed")) if s[k]]
    return cell + (" " + ", ".join(rest) if rest else "")


def _cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(summary: dict[tuple[str, str], dict]) -> list[str]:
    """The results table, one line per (engine, temperature), each at most ``WIDTH`` characters.

    Args:
        summary: ``{(engine, "cold"|"warm"): summarise(...)}`` in print order.

    Returns:
        Header, rule and rows: decode tok/s (a ``*`` marks a timed-out run's
        rate so far), TTFT s, hit rate, peak RSS GiB, completed / runs with
        OOM kills and timeouts, and tok/s as a ratio to mlx-tier's (same
        temperature).
    """
    head = f"{'engine':<17} {'run':<4} {'tok/s':>7} {'TTFT s':>7} {'hit':>4} {'RSS GiB':>7}  {'completed':<19} {'vs tier':>7}"
    lines = [head, "-" * len(head)]
    for (engine, temp), s in summary.items():
        tier = summary.get(("mlx-tier", temp), {}).get("tok_s")
        if "tok_s" in s:
            speed = f"{s['tok_s']:.2f} "
        elif "partial_tok_s" in s:
            speed = f"{s['partial_tok_s']:.2f}*"
        else:
            speed = "- "
        ratio = f"{s['tok_s'] / tier:.2f}x" if tier and "tok_s" in s else "-"
        rss = s["peak_rss"] / GIB if "peak_rss" in s else None
        lines.append(f"{engine:<17} {temp:<4} {speed:>7} {_cell(s.get('ttft'), '.2f'):>7} "
                     f"{_cell(s.get('hit_rate'), '.0%'):>4} {_cell(rss, '.2f'):>7}  {outcome_cell(s)[:19]:<19} {ratio:>7}")
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
    parts = [f"{e} {s['tok_s'] / tier:.2f}x" if "tok_s" in s else f"{e} {outcome_cell(s)}"
             for (e, t), s in summary.items() if t == temp and e != "mlx-tier"]
    return (f"headline ({temp}, load moved {spread:.2f} <= {tolerance:.2f}): mlx-tier {tier:.2f} tok/s; "
            + "; ".join(parts))


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


def _outcome(events: list[dict], timed_out: bool, oom: int, stderr: str, code: int, timeout: int) -> str:
    phase = events[-1]["phase"] if events else "starting"
    if events and phase == "done":
        return "ok"
    if timed_out:
        return f"timed out after {timeout} s while {phase}"
    if oom:
        return f"OOM-killed while {phase}"
    tail = stderr.strip().splitlines()[-1:] or [f"exit code {code}"]
    return f"failed while {phase}: {tail[0][:160]}"


def run_once(spec, cgroup, timeout: int) -> dict:
    """One run of ``spec`` (a ``peers_engines.RunSpec``) in a fresh process, inside ``cgroup`` when given."""
    cmd = [sys.executable, str(HERE / "peers_engines.py"), json.dumps(dataclasses.asdict(spec))]
    oom_before = 0
    if cgroup is not None:
        cgroup.reset_peak()
        oom_before = cgroup.oom_kills()
        cmd = cgroup.wrap(cmd)
    run = {"engine": spec.engine, "load1_start": os.getloadavg()[0]}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE)
    with LoadSampler(proc.pid) as sampler:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            timed_out = True
    run.update(load1_end=os.getloadavg()[0], others=sampler.mean(), returncode=proc.returncode)
    events = _events(stdout)
    oom = cgroup.oom_kills() - oom_before if cgroup is not None else 0
    run["outcome"] = _outcome(events, timed_out, oom, stderr, proc.returncode, timeout)
    if cgroup is not None:
        run["cgroup_peak"] = cgroup.read("memory.max_usage_in_bytes")
    if run["outcome"] == "ok":
        run.update(events[-1]["result"])
    progress = [e for e in events if e["phase"] == "progress"]
    if run["outcome"] != "ok" and progress and progress[-1]["tokens"] > 1:
        last = progress[-1]
        run.update(ttft=last["ttft"], partial_tok_s=(last["tokens"] - 1) / last["decode_s"])
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


def run_rounds(specs: dict, temps: tuple[str, ...], rounds: int, files: list[Path], cgroup, timeout: int,
               log=print) -> dict[tuple[str, str], list[dict]]:
    """Interleaved rounds (engine order rotated each round), cold then warm; ``{(engine, temp): runs}``."""
    from pagecache import drop_pages

    names = list(specs)
    runs: dict[tuple[str, str], list[dict]] = {(e, t): [] for e in names for t in temps}
    if temps == ("warm",):  # warm-only: prime the page cache once per engine, untimed
        for e in names:
            short = dataclasses.replace(specs[e], max_tokens=min(specs[e].max_tokens, 16))
            log(f"  priming {e}: {run_once(short, cgroup, timeout)['outcome']}")
    for r in range(rounds):
        for e in names[r % len(names):] + names[: r % len(names)]:
            for temp in temps:
                if temp == "cold":
                    drop_pages(files)
                run = run_once(specs[e], cgroup, timeout)
                runs[(e, temp)].append(run)
                speed = (f", {run['tok_s']:.2f} tok/s" if "tok_s" in run else
                         f", {run['partial_tok_s']:.2f} tok/s so far" if "partial_tok_s" in run else "")
                log(f"  round {r + 1}/{rounds} {e:<17} {temp}: {run['outcome'][:60]}{speed}")
    return runs


def prompt_ids(model: Path, n: int) -> list[int]:
    """The first ``n`` token ids of a fixed English text (repeated if short), the checkpoint's tokenizer."""
    from capped import TEXT
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    ids = load_tokenizer(model).encode(TEXT)
    return (ids * (n // len(ids) + 1))[:n]


def caliber_lines(args, prep: Prepared, capped: bool, runs: dict, cache_gb: float, budget: int) -> list[str]:
    """The header: machine, cap, model, prompt, tokens, runs, load."""
    from mlx_tier.jobs import backend_name

    cfg = json.loads((prep.model / "config.json").read_text())
    ckpt = sum(f.stat().st_size for f in prep.model.glob("*.safetensors"))
    all_runs = [r for rs in runs.values() for r in rs]
    l1 = [r[k] for r in all_runs for k in ("load1_start", "load1_end")]
    others = [r["others"] for r in all_runs if r.get("others") is not None]
    cap = f"{args.cap_gb:g} GiB cgroup v1 (page cache charged)" if capped else "NONE (runs uncapped)"
    lines = [
        f"machine: {platform.machine()} {platform.system()}, {psutil.cpu_count()} cores, "
        f"{psutil.virtual_memory().total / GIB:.0f} GiB, MLX {backend_name()}; cap: {cap}",
        f"model: {prep.model.name}, {cfg['model_type']}, {ckpt / GIB:.2f} GiB"
        + (f" = {ckpt / (args.cap_gb * GIB):.1f}x the cap" if args.cap_gb else "")
        + f"; {cfg['num_hidden_layers']} layers x {cfg.get('num_experts', '?')} experts, "
        f"top-{cfg.get('num_experts_per_tok', '?')}",
        f"single request, prompt {args.prompt_tokens} tokens, {args.tokens} greedy tokens; {args.runs} "
        f"run{'s' if args.runs > 1 else ''} x {'+'.join(args.temps)}, interleaved, medians; mlx-tier cache {cache_gb:g} GiB "
        f"(kernel {args.tier_kernel}); nunspark budget {budget / 1e9:.2f} GB",
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
    ap.add_argument("--run-timeout", type=int, default=900, help="seconds before a run is killed")
    ap.add_argument("--work", type=Path, default=None, help="packed and GGUF copies (default: $MLX_TIER_CACHE/peers)")
    ap.add_argument("--json", type=Path, default=None, help="results file (default: under $MLX_TIER_CACHE)")
    args = ap.parse_args(argv)
    if args.caliber:
        c = CALIBERS[args.caliber]
        args.runs, args.tokens, args.temps = c["runs"], c["tokens"], ",".join(c["temps"])
    args.temps = tuple(t for t in ("cold", "warm") if t in args.temps.split(","))
    return args


def check_args(args) -> str | None:
    """One line saying what is wrong with the arguments, or ``None``."""
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
    return None


def report(args, prep: Prepared, capped: bool, runs: dict, cache_gb: float, budget: int,
           notes: list[str]) -> dict:
    """Print the caliber, table, headline and notes; the summary keyed ``"engine | temp"``."""
    summary = {key: summarise(rs) for key, rs in runs.items()}
    print()
    for line in caliber_lines(args, prep, capped, runs, cache_gb, budget):
        print(line)
    print()
    for line in table(summary):
        print(line)
    head_temp = "warm" if "warm" in args.temps else args.temps[0]
    head_runs = [r for (_, t), rs in runs.items() if t == head_temp for r in rs]
    loads = [x for x in map(run_load, head_runs) if x is not None]
    what = "others' runnable tasks" if all(r.get("others") is not None for r in head_runs) else "load average"
    print()
    for line in [headline(summary, head_temp, loads, args.load_tolerance, what), token_agreement(runs), *notes]:
        for w in wrap(line, indent=""):
            print(w)
    if any("partial_tok_s" in s for s in summary.values()):
        print("* no run completed: the rate over the tokens decoded before the timeout")
    return {f"{e} | {t}": s for (e, t), s in summary.items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    problem = check_args(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    from capped import DEFAULT_CACHE_FRACTION, open_cgroup
    from make_synthetic_moe import ensure_synthetic
    from mlx_tier.demo_model import cache_dir

    engines, notes = [], []
    for e in args.engines.split(","):
        hint = install_hint(e)
        if hint:
            notes.append(hint)
            print(hint)
        else:
            engines.append(e)
    model = (args.model or ensure_synthetic()).resolve()
    prep = prepare(model, engines, args.work or cache_dir() / "peers")
    cache_gb = args.cache_gb or round((args.cap_gb or 2.0) * DEFAULT_CACHE_FRACTION, 3)
    budget = int(args.budget_gb * 1e9) if args.budget_gb else int(cache_gb * GIB) + dense_bytes(model)
    specs = make_specs(engines, prep, prompt_ids(model, args.prompt_tokens), args.tokens, cache_gb, budget,
                       args.tier_kernel)
    print(f"{len(engines)} engines x {args.runs} runs x {'+'.join(args.temps)}, {args.tokens} tokens each", flush=True)
    with contextlib.ExitStack() as stack:
        cgroup = open_cgroup(int(args.cap_gb * GIB), notes, stack) if args.cap_gb else None
        if not args.cap_gb:
            notes.append("--cap-gb 0: runs are uncapped on purpose")
        runs = run_rounds(specs, args.temps, args.runs, prep.files(), cgroup, args.run_timeout)
    summary = report(args, prep, cgroup is not None, runs, cache_gb, budget, notes)
    out = args.json or cache_dir() / f"bench-peers-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "notes": notes,
                               "capped": cgroup is not None, "cache_gb": cache_gb, "budget_bytes": budget,
                               "summary": summary, "runs": {f"{e} | {t}": rs for (e, t), rs in runs.items()}},
                              indent=1, default=str))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
