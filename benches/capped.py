"""A model larger than memory, for real: decode under a memory cap, cold and warm.

Question: under a memory cap smaller than the
checkpoint, how fast does mlx-tier decode compared with the I/O + compute
roofline at the hit rate it reaches, and does it stay within the cap? Plain
mlx-lm runs under the same cap on the same model (it is expected to be
OOM-killed or to thrash; what happens is reported).

How:
- The model: the synthetic qwen3_moe of ``benches/make_synthetic_moe.py``
  (default 2 GiB, 6 layers x 128 experts of 2.5 MiB, top-8), built when missing.
- The cap: a Linux cgroup v1 memory group, created as a child of this
  process's own memory cgroup and removed at the end (even on error).
  ``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes``: no swap
  either) = ``--cap-gb``; the page cache is charged to it, so the checkpoint
  cannot hide in memory. Each engine run is a fresh process started inside the
  group (``sh -c 'echo $$ > cgroup.procs; exec python ...'``), so an OOM kill
  ends only that run. Peak = ``memory.max_usage_in_bytes`` (reset per run,
  page cache included), plus the process's own peak RSS; OOM kills from
  ``memory.oom_control``. Without cgroup v1 (macOS, cgroup v2) the runs are
  uncapped and the report says so (on a Mac the model is simply larger than RAM).
- Cold: the checkpoint's pages evicted before the process starts
  (``posix_fadvise(DONTNEED)`` per shard; ``--drop-caches`` also writes
  ``/proc/sys/vm/drop_caches``). Warm: the same engine again right after, not
  dropped (the page cache then holds what the previous run left within the cap).
- Engines: plain mlx-lm (float32 compute like mlx-tier on the CPU backend)
  capped, and uncapped as the "fully resident" reference; mlx-tier with each
  ``--policies`` x ``--prefetch`` (``on`` is skipped with a note while
  ``TierConfig`` has no ``prefetch`` field). Runs interleaved, ``--runs`` each.
- Per run: load time, TTFT (prompt in, first token out; excludes load), TPOT
  and decode tok/s over the remaining tokens, hit rate / bytes read per token /
  I/O stall fraction (time the forward pass waited on reads / decode wall
  time) during decode.
- Decode tokens (``--decode``): ``forced`` (default) feeds a fixed English
  text one token at a time through the KV cache, exactly a decode step's work;
  ``greedy`` decodes the model's own argmax. Why forced by default: a random
  model's greedy output falls into repeating one token within a few steps
  ("... Patrick Patrick Patrick"), so the same experts are routed every step
  and ~93% of them hit even with 24 of 128 slots: a flattering, unrealistic
  cache workload. Forced text keeps routing as varied as the text is.
- Roofline (docs/architecture.md): ``1 / (missed_bytes_per_token / disk_bw +
  active_bytes_per_token / compute_bw)`` with the run's own bytes read per
  decoded token and disk bandwidth measured here (``mlx_tier.tools.plan``: random
  4 MiB reads, pages dropped; sampled before and after every round since the
  machine may be shared, median used). Compute bandwidth: active bytes per
  token / TPOT of plain mlx-lm fully resident (uncapped) on the same model in
  the same bench, i.e. measured on the model's own kernels; the 4-bit matvec
  microbench of ``mlx_tier.tools.plan`` is the fallback (``--no-reference``) and is
  printed beside it (on the shared 2-core machine it ranged 0.15-0.52 GB/s
  and under-stated the model's rate, giving efficiencies above 100%).
  Efficiency = measured / roofline. With prefetch on, the bytes read
  include prefetched experts (used or wasted), and since the roofline sums I/O
  and compute time, overlapping them can exceed it.
- Targets, printed pass/miss with the margin: decode tok/s >= 80% of the
  roofline; memory: no OOM kill, peak RSS <= cap, no swap.

Run on a quiet machine for headline numbers (>= 9 runs, docs/architecture.md):

    MLX_TIER_CACHE=/tmp/mtcache python benches/capped.py --runs 9 --json capped.json

Defaults (``--runs 3``, 3 policies x prefetch off/on, plain mlx-lm capped and
uncapped, cold and warm: 48 runs) took 15 min on the 2-core build machine
shared with other jobs. Quick check: ``--runs 1 --policies lru --prefetch off``.
Needs root for the cgroup (else it runs uncapped and says so).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import psutil
from make_synthetic_moe import ensure_synthetic
from pagecache import drop_pages

GIB = 1024**3
CGROUP_V1 = Path("/sys/fs/cgroup/memory")
# Prompt and, for --decode forced, the tokens fed one at a time after it.
TEXT = ("The history of the city of Paris begins with a small settlement on an island in the river, "
        "where fishermen and traders lived for centuries before the Romans arrived and built a town. "
        "In the middle ages the city grew into a centre of learning and trade, its university drew "
        "students from all over Europe, and its cathedral rose above the narrow streets of the old quarter.")
TARGET_EFFICIENCY = 0.8
# The process outside its expert cache (imports, dense part, activations, read
# buffers) took ~0.55 GiB at the default shapes (measured: peak RSS 820 MiB with
# a 405 MiB cache), so the default cache is 40% of the cap.
DEFAULT_CACHE_FRACTION = 0.4


# --------------------------------------------------------------------- cgroup v1
class MemoryCgroup:
    """A child cgroup v1 memory group with a hard limit; removed on exit.

    Args:
        limit_bytes: ``memory.limit_in_bytes`` (and ``memsw`` when present).
        name: directory name of the group.

    Raises:
        OSError: no cgroup v1 memory controller, or no permission (not root).
    """

    def __init__(self, limit_bytes: int, name: str):
        own = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                   if line.split(":", 2)[1] == "memory")
        self.parent = CGROUP_V1 / own.lstrip("/")
        self.path = self.parent / name
        self.limit = limit_bytes
        self.memsw = False

    def __enter__(self) -> Self:
        self.path.mkdir()
        try:
            self._write("memory.limit_in_bytes", self.limit)
            if (self.path / "memory.memsw.limit_in_bytes").exists():
                self._write("memory.memsw.limit_in_bytes", self.limit)  # memory + swap: no swap
                self.memsw = True
        except OSError:
            self.path.rmdir()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for _ in range(50):  # tasks still inside (a killed run's children) go back to the parent
            pids = (self.path / "cgroup.procs").read_text().split()
            for pid in pids:
                try:
                    (self.parent / "cgroup.procs").write_text(pid)
                except OSError:
                    pass
            try:
                self.path.rmdir()  # its page cache is handed to the parent
                return
            except OSError:
                time.sleep(0.1)
        print(f"warning: could not remove {self.path}", file=sys.stderr)

    def _write(self, name: str, value) -> None:
        (self.path / name).write_text(f"{value}\n")

    def read(self, name: str) -> int:
        return int((self.path / name).read_text().split()[0])

    def oom_kills(self) -> int:
        for line in (self.path / "memory.oom_control").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def reset_peak(self) -> None:
        self._write("memory.max_usage_in_bytes", 0)

    def wrap(self, cmd: list[str]) -> list[str]:
        """``cmd`` started inside the group from its first instruction."""
        procs = self.path / "cgroup.procs"
        return ["sh", "-c", f'echo $$ > "{procs}" && exec "$@"', "sh", *cmd]


# ------------------------------------------------------------------- the worker
@dataclass(frozen=True)
class Engine:
    """One engine configuration; ``kind`` is ``"mlx-lm"`` or ``"mlx-tier"``."""

    kind: str
    capped: bool = True
    policy: str = "lru"
    prefetch: bool | None = None  # None: the TierConfig field is absent
    cache_gb: float = 0.0
    read_method: str = "pread"
    page_cache: str = "keep"
    kernel: str = "mlx"  # TierConfig.kernel: what computes the experts (mlx_tier.kernels.registry)

    @property
    def name(self) -> str:
        if self.kind == "mlx-lm":
            return "mlx-lm" + ("" if self.capped else " (uncapped)")
        pf = "" if self.prefetch is None else f" prefetch {'on' if self.prefetch else 'off'}"
        kern = "" if self.kernel == "mlx" else f" kernel {self.kernel}"
        return f"mlx-tier {self.policy}{pf}{kern}"


def _emit(**event) -> None:
    print(json.dumps(event), flush=True)


def worker(spec: dict) -> None:
    """Inside the capped process: load one engine, generate once, print JSON events."""
    engine = Engine(**spec["engine"])
    _emit(phase="importing")
    import mlx.core as mx
    from mlx_lm import load as mlx_load
    from mlx_lm import stream_generate
    from mlx_lm.models.cache import make_prompt_cache

    import mlx_tier
    from mlx_tier import TierConfig
    from mlx_tier.engine.dtypes import job_compute_dtype
    from mlx_tier.engine.sizes import peak_rss

    t0 = time.perf_counter()
    _emit(phase="loading")
    cache = None
    if engine.kind == "mlx-lm":
        model, tokenizer = mlx_load(spec["model"])
        model.set_dtype(mx.float32)  # as the mlx-tier engines compute here (job_compute_dtype)
        mx.eval(model.parameters())
    else:
        extra = {} if engine.prefetch is None else {"prefetch": engine.prefetch}
        config = TierConfig(cache_gb=engine.cache_gb, policy=engine.policy, read_method=engine.read_method,
                            page_cache=engine.page_cache, kernel=engine.kernel, dtype=job_compute_dtype(), **extra)
        model, tokenizer = mlx_tier.load(spec["model"], config=config)
        cache = model.expert_cache
    load_s = time.perf_counter() - t0
    _emit(phase="generating", load_s=load_s, rss=psutil.Process().memory_info().rss)
    P, N = spec["prompt_tokens"], spec["max_tokens"]
    ids = tokenizer.encode(TEXT)
    ids = (ids * ((P + N) // len(ids) + 1))[: P + N]
    prompt, forced = ids[:P], ids[P + 1 :]
    t0 = time.perf_counter()
    first = s_first = None
    n = 0
    if spec["decode"] == "greedy":
        for resp in stream_generate(model, tokenizer, prompt, max_tokens=N):
            n = resp.generation_tokens
            if first is None:
                first = time.perf_counter()
                s_first = cache.stats.as_dict() if cache is not None else None
    else:  # teacher-forced: each step is one token through the KV cache, as in decoding
        kv = make_prompt_cache(model)
        mx.eval(model(mx.array([prompt]), cache=kv))
        first = time.perf_counter()
        s_first = cache.stats.as_dict() if cache is not None else None
        for t in forced:
            mx.eval(model(mx.array([[t]]), cache=kv))
        n = 1 + len(forced)
    end = time.perf_counter()
    out = {"load_s": load_s, "ttft": first - t0, "tokens": n, "decode_s": end - first,
           "tpot": (end - first) / max(n - 1, 1),
           "peak_rss": peak_rss(),
           "mlx_peak": mx.get_peak_memory()}
    if cache is not None:
        s = cache.stats.as_dict()
        wait = "stall_seconds" if "stall_seconds" in s else "read_seconds"  # stall: prefetch-aware
        d = {k: s[k] - s_first[k] for k in ("hits", "misses", "bytes_read", wait)}
        steps = max(n - 1, 1)
        out.update(hit_rate=d["hits"] / max(d["hits"] + d["misses"], 1), bytes_per_token=d["bytes_read"] / steps,
                   io_fraction=d[wait] / max(end - first, 1e-9), slots=cache.slots_per_layer,
                   resident_bytes=cache.resident_bytes, prefill_hit_rate=s_first["hit_rate"],
                   stats_end=s)
    _emit(phase="done", result=out)


# ------------------------------------------------------------------- the parent
def run_engine(engine: Engine, args, cgroup: MemoryCgroup | None) -> dict:
    """One run of ``engine`` in a fresh process (inside ``cgroup`` when capped)."""
    spec = {"engine": dataclasses.asdict(engine), "model": str(args.model), "decode": args.decode,
            "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    capped = cgroup is not None and engine.capped
    before = {}
    if capped:
        cgroup.reset_peak()
        before = {"failcnt": cgroup.read("memory.failcnt"), "oom": cgroup.oom_kills()}
        cmd = cgroup.wrap(cmd)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parent)
    try:
        stdout, stderr = proc.communicate(timeout=args.run_timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        timed_out = True
    events = []
    for line in stdout.splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    run = {"engine": engine.name, "returncode": proc.returncode, "wall_s": time.perf_counter() - t0,
           "last_phase": events[-1]["phase"] if events else "starting"}
    done = events[-1] if events and events[-1]["phase"] == "done" else None
    if done is not None:
        run.update(done["result"])
    if capped:
        run.update(cgroup_peak=cgroup.read("memory.max_usage_in_bytes"),
                   failcnt=cgroup.read("memory.failcnt") - before["failcnt"],
                   oom_kills=cgroup.oom_kills() - before["oom"])
    if timed_out:
        run["outcome"] = f"timed out after {args.run_timeout} s while {run['last_phase']} (thrashing?)"
    elif done is None and run.get("oom_kills"):
        run["outcome"] = f"OOM-killed while {run['last_phase']}"
    elif done is None:
        tail = stderr.strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        run["outcome"] = f"failed while {run['last_phase']}: {tail[0][:160]}"
    else:
        run["outcome"] = "ok"
    return run


def open_cgroup(cap: int, notes: list[str], stack: contextlib.ExitStack) -> MemoryCgroup | None:
    """The capped group (closed by ``stack``), or ``None`` with a note saying why runs are uncapped."""
    if not CGROUP_V1.is_dir():
        notes.append("no cgroup v1 memory controller (macOS or cgroup v2): runs are NOT capped")
        return None
    try:
        return stack.enter_context(MemoryCgroup(cap, f"mlx-tier-bench-{os.getpid()}"))
    except (OSError, StopIteration) as e:
        notes.append(f"cgroup not created ({e or 'no memory cgroup for this process'}): runs are NOT capped")
        return None


def roofline(run: dict, active: int, disk_gbps: float, compute_gbps: float) -> float:
    """docs/architecture.md roofline at the run's own bytes read per token, tok/s (``active``: bytes per token)."""
    t = run["bytes_per_token"] / (disk_gbps * 1e9) + active / (compute_gbps * 1e9)
    return 1 / t


def _med(runs: list[dict], key: str):
    vals = [r[key] for r in runs if key in r]
    return statistics.median(vals) if vals else None


def summarise(runs: list[dict]) -> dict:
    ok = [r for r in runs if r["outcome"] == "ok"]
    s = {"runs": len(runs), "ok": len(ok), "outcomes": sorted({r["outcome"] for r in runs})}
    for k in ("load_s", "ttft", "tpot", "hit_rate", "bytes_per_token", "io_fraction", "roofline",
              "efficiency", "peak_rss", "cgroup_peak", "mlx_peak", "failcnt", "tokens"):
        v = _med(ok if k not in ("cgroup_peak", "failcnt") else runs, k)
        if v is not None:
            s[k] = v
    if "tpot" in s:
        s["tok_s"] = 1 / s["tpot"]
    s["oom_kills"] = sum(r.get("oom_kills", 0) for r in runs)
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, default=None, help="checkpoint (default: the synthetic 2 GiB MoE)")
    ap.add_argument("--cap-gb", type=float, default=1.0, help="memory cap, GiB (page cache included)")
    ap.add_argument("--cache-gb", type=float, default=None,
                    help=f"mlx-tier expert cache, GiB (default {DEFAULT_CACHE_FRACTION * 100:.0f}%% of the cap)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--policies", default="lru,lfu,2q")
    ap.add_argument("--prefetch", default="off,on", help="comma list of on/off")
    ap.add_argument("--kernels", default="mlx", help="mlx-tier expert kernels, comma list (mlx, cpu: "
                    "side by side at the same policy and cache; cpu also serves the dense quantized layers)")
    ap.add_argument("--read-method", default=None, help="mlx-tier read method (default: TierConfig's)")
    ap.add_argument("--page-cache", default=None, help="mlx-tier page-cache mode (default: TierConfig's)")
    ap.add_argument("--prompt-tokens", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens out (forced: steps + 1)")
    ap.add_argument("--decode", choices=["forced", "greedy"], default="forced",
                    help="forced: feed a fixed text token by token (default, see the module doc); "
                         "greedy: the model's own argmax tokens")
    ap.add_argument("--no-reference", action="store_true", help="skip plain mlx-lm uncapped")
    ap.add_argument("--no-plain", action="store_true", help="skip plain mlx-lm under the cap")
    ap.add_argument("--drop-caches", action="store_true",
                    help="cold runs also write /proc/sys/vm/drop_caches (the whole machine's page cache)")
    ap.add_argument("--run-timeout", type=int, default=600, help="seconds per run before it is killed")
    ap.add_argument("--json", type=Path, default=None, help="results file (default: under $MLX_TIER_CACHE)")
    args = ap.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return

    from mlx_tier import TierConfig
    from mlx_tier.job.report import backend_name
    from mlx_tier.tools.plan import make_plan, measure_compute_gbps, measure_disk_gbps

    args.model = (args.model or ensure_synthetic()).resolve()
    cap = int(args.cap_gb * GIB)
    cache_gb = args.cache_gb if args.cache_gb is not None else round(args.cap_gb * DEFAULT_CACHE_FRACTION, 3)
    defaults = TierConfig()
    read_method = args.read_method or defaults.read_method
    page_cache = args.page_cache or defaults.page_cache
    TierConfig(read_method=read_method, page_cache=page_cache)  # validates
    has_prefetch = "prefetch" in {f.name for f in dataclasses.fields(TierConfig)}
    notes = []
    prefetch = []
    for p in args.prefetch.split(","):
        if p not in ("on", "off"):
            sys.exit(f"error: --prefetch takes on/off, got {p!r}")
        if not has_prefetch:
            if p == "on":
                notes.append("prefetch on: skipped, TierConfig has no `prefetch` field yet")
            elif None not in prefetch:
                prefetch.append(None)
        else:
            prefetch.append(p == "on")
    engines = []
    if not args.no_plain:
        engines.append(Engine("mlx-lm"))
    if not args.no_reference:
        engines.append(Engine("mlx-lm", capped=False))
    engines += [Engine("mlx-tier", policy=pol, prefetch=pf, cache_gb=cache_gb, read_method=read_method,
                       page_cache=page_cache, kernel=kern)
                for pol in args.policies.split(",") for pf in prefetch for kern in args.kernels.split(",")]

    shards = sorted(args.model.glob("*.safetensors"))
    ckpt = sum(f.stat().st_size for f in shards)
    print(f"model {args.model} ({ckpt / GIB:.2f} GiB), cap {args.cap_gb} GiB, cache {cache_gb} GiB; "
          f"{len(engines)} engines x {args.runs} runs x cold+warm", flush=True)
    disk, compute = [], []

    def sample_bandwidths() -> None:  # the machine is shared: sampled between rounds, medians used
        disk.append(measure_disk_gbps(shards, total_mb=128))
        compute.append(measure_compute_gbps(reps=50))

    sample_bandwidths()
    plan = make_plan(args.model, disk_gbps=disk[0], compute_gbps=compute[0])

    runs: dict[tuple[str, str], list[dict]] = {}
    drop_method = None
    with contextlib.ExitStack() as stack:
        cgroup = open_cgroup(cap, notes, stack)
        memsw = cgroup.memsw if cgroup is not None else False
        for i in range(args.runs):
            for engine in engines[i % len(engines):] + engines[: i % len(engines)]:
                for temp in ("cold", "warm"):
                    if temp == "cold":
                        drop_method = drop_pages(shards, global_drop=args.drop_caches)
                    r = run_engine(engine, args, cgroup)
                    runs.setdefault((engine.name, temp), []).append(r)
                    print(f"  run {i + 1}/{args.runs} {engine.name:28} {temp}: {r['outcome']}"
                          + (f", {1 / r['tpot']:.2f} tok/s" if "tpot" in r else "")
                          + (f", hit {r['hit_rate']:.0%}" if "hit_rate" in r else ""),
                          flush=True)
            sample_bandwidths()

    disk_gbps, matvec_gbps = statistics.median(disk), statistics.median(compute)
    active = plan.dense_bytes + plan.moe_layers * plan.top_k * plan.expert_bytes_disk
    resident = [r["tpot"] for (name, _), rs in runs.items() if name == "mlx-lm (uncapped)"
                for r in rs if r["outcome"] == "ok"]
    # Compute bandwidth on this model itself: plain mlx-lm with every weight
    # resident streams the active bytes once per decoded token.
    compute_gbps = active / statistics.median(resident) / 1e9 if resident else matvec_gbps
    compute_source = (f"plain mlx-lm fully resident on this model (active bytes / median TPOT of {len(resident)} "
                      f"runs); the 4-bit matvec microbench gave {matvec_gbps:.2f} GB/s (median of {len(compute)}, "
                      f"range {min(compute):.2f}-{max(compute):.2f})" if resident else
                      f"4-bit matvec microbench, median of {len(compute)}, range {min(compute):.2f}-{max(compute):.2f} "
                      "(no uncapped mlx-lm run to measure the model itself)")
    for rs in runs.values():
        for r in rs:
            if "bytes_per_token" in r and r["outcome"] == "ok":
                r["roofline"] = roofline(r, active, disk_gbps, compute_gbps)
                r["efficiency"] = (1 / r["tpot"]) / r["roofline"]
    summary = {f"{name} | {temp}": summarise(rs) for (name, temp), rs in runs.items()}
    swap_total = psutil.swap_memory().total

    print("\ncaliber:")
    print(f"  machine: {platform.machine()} {platform.system()} {platform.release()}, {psutil.cpu_count()} cores "
          f"(load average {os.getloadavg()[1]:.1f} over the last 5 min: other jobs on it inflate timings), "
          f"{psutil.virtual_memory().total / GIB:.0f} GiB, "
          f"swap {swap_total / GIB:.1f} GiB; backend {backend_name()}")
    print(f"  model: {args.model.name}, {plan.model_type}, {ckpt / GIB:.2f} GiB on disk = "
          f"{ckpt / cap:.1f}x the cap; {plan.moe_layers} MoE layers x {plan.experts_per_layer} experts, "
          f"top-{plan.top_k}, {plan.expert_bytes_disk / 2**20:.2f} MiB per expert on disk; "
          f"active per token {(plan.dense_bytes + plan.moe_layers * plan.top_k * plan.expert_bytes_disk) / 2**20:.0f} MiB")
    print(f"  cap: {args.cap_gb} GiB cgroup v1 limit (page cache charged"
          f"{', memsw = cap' if memsw else ''})" if cgroup is not None else "  cap: NONE (see notes)")
    print(f"  mlx-tier: cache {cache_gb} GiB, read {read_method}/{page_cache}, compute float32")
    print(f"  single request, prompt {args.prompt_tokens} tokens, output {args.max_tokens} tokens; "
          f"{args.runs} runs per engine and temperature, medians; cold = pages dropped by {drop_method}, "
          "warm = rerun right after")
    print(f"  roofline: disk {disk_gbps:.2f} GB/s (random 4 MiB reads, pages dropped; median of {len(disk)} samples "
          f"between rounds, range {min(disk):.2f}-{max(disk):.2f}); compute {compute_gbps:.2f} GB/s from "
          f"{compute_source}")
    print(f"  decode: {'teacher-forced text' if args.decode == 'forced' else 'greedy generation'}"
          + (" (a random model's greedy output repeats one token, which would turn nearly every expert "
             "into a hit; see the module doc)" if args.decode == "forced" else ""))
    for note in notes:
        print(f"  note: {note}")
    print(f"\n{'engine':28} {'temp':4} {'outcome':22} {'load s':>6} {'TTFT s':>7} {'TPOT s':>7} {'tok/s':>6} "
          f"{'hit':>5} {'MiB/tok':>7} {'I/O':>5} {'roof':>6} {'eff':>5} {'peak GiB':>8} {'RSS GiB':>7}")
    for key, s in summary.items():
        name, temp = key.split(" | ")
        outcome = "ok" if s["ok"] == s["runs"] else "; ".join(s["outcomes"])

        def f(k, fmt, scale=1.0, s=s):
            return format(s[k] * scale, fmt) if k in s else "-"

        print(f"{name:28} {temp:4} {outcome[:22]:22} {f('load_s', '6.1f'):>6} {f('ttft', '7.2f'):>7} "
              f"{f('tpot', '7.3f'):>7} {f('tok_s', '6.2f'):>6} {f('hit_rate', '5.0%'):>5} "
              f"{f('bytes_per_token', '7.1f', 2**-20):>7} {f('io_fraction', '5.0%'):>5} {f('roofline', '6.2f'):>6} "
              f"{f('efficiency', '5.0%'):>5} {f('cgroup_peak', '8.2f', 1 / GIB):>8} {f('peak_rss', '7.2f', 1 / GIB):>7}")
        if len(outcome) > 22:
            print(f"{'':28} {'':4} {outcome}")

    print(f"\ntargets (decode tok/s >= {TARGET_EFFICIENCY:.0%} of the roofline at the measured hit rate; "
          "memory: no OOM kill, peak RSS <= cap, no swap):")
    ref = summary.get("mlx-lm (uncapped) | warm", {})
    for key, s in summary.items():
        if not key.startswith("mlx-tier"):
            continue
        if "efficiency" in s:
            margin = s["efficiency"] - TARGET_EFFICIENCY
            speed = f"{'PASS' if margin >= 0 else 'MISS'} ({s['efficiency']:.0%}, margin {margin:+.0%})"
        else:
            speed = "MISS (no successful run)"
        no_swap = swap_total == 0 or memsw  # no device, or memory + swap capped together
        mem_ok = s["oom_kills"] == 0 and s.get("peak_rss", cap + 1) <= cap and no_swap
        mem = (f"{'PASS' if mem_ok else 'MISS'} (RSS {s.get('peak_rss', 0) / GIB:.2f} of {args.cap_gb} GiB, "
               f"margin {(cap - s.get('peak_rss', 0)) / GIB:+.2f} GiB, OOM kills {s['oom_kills']})")
        vs_ref = (f"; {s['tok_s'] / ref['tok_s']:.2f}x plain mlx-lm uncapped"
                  if "tok_s" in s and "tok_s" in ref else "")
        print(f"  {key:36} speed {speed}; memory {mem}{vs_ref}")

    from mlx_tier.fsio import user_cache_dir as cache_dir

    out = args.json or cache_dir() / f"bench-capped-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "caliber": {"machine": platform.platform(), "cpu_count": psutil.cpu_count(),
                    "load_average_5min": os.getloadavg()[1],
                    "memory_gib": psutil.virtual_memory().total / GIB, "swap_bytes": swap_total,
                    "model": str(args.model), "checkpoint_bytes": ckpt, "cap_bytes": cap,
                    "capped": cgroup is not None, "memsw": memsw, "cache_gb": cache_gb,
                    "read_method": read_method, "page_cache": page_cache, "prompt_tokens": args.prompt_tokens,
                    "max_tokens": args.max_tokens, "runs": args.runs, "drop_method": drop_method,
                    "disk_gbps_samples": disk, "compute_gbps_samples": compute, "disk_gbps": disk_gbps,
                    "compute_gbps": compute_gbps, "compute_source": compute_source, "matvec_gbps": matvec_gbps,
                    "decode": args.decode, "plan": plan.as_dict(), "notes": notes},
        "summary": summary,
        "runs": {f"{n} | {t}": rs for (n, t), rs in runs.items()},
    }, indent=2, default=str))
    print(f"\nresults: {out}")


if __name__ == "__main__":
    main()
