"""Round 19's diagnosis: the resident set of benches/throughput.py's worker up to its pool plan.

Runs the worker (the 8 GB synthetic at /tmp/throughput/synth-24, throughput schedule)
N times in a 2 GiB cgroup v1 group, the checkpoint's pages evicted first, and prints
RssAnon, RssFile, threads, MLX's memory and the largest anonymous mappings at each
stage (start, after the cache chooser's probes, after the load, after the shared
prefix, after the plan), then the decode pool planned. Needs root (the cgroup).

    python diag_plan.py PATH/TO/benches N
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(sys.argv[1]).resolve()  # benches dir of the tree under test
sys.path.insert(0, str(BENCH))

def anon_maps():
    maps, cur = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and not parts[0].endswith(":"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                cur = [parts[5] if len(parts) > 5 else "anon", (hi - lo) >> 10, 0, parts[0]]
                maps.append(cur)
            elif parts[0] == "Anonymous:":
                cur[2] = int(parts[1])
    return maps

def status():
    d = dict(l.split(":", 1) for l in open("/proc/self/status"))
    return {k: d[k].strip() for k in ("RssAnon", "RssFile", "Threads")}

def dump(stage):
    import mlx.core as mx
    maps = anon_maps()
    tot = {}
    for name, size, anon, _ in maps:
        key = name if name.startswith("[") or name == "anon" else "file"
        tot[key] = tot.get(key, 0) + anon
    top = sorted(maps, key=lambda m: -m[2])[:12]
    print(json.dumps({"stage": stage, "t": round(time.time() - T0, 1), **status(),
                      "mlx_active": mx.get_active_memory() >> 20, "mlx_cache": mx.get_cache_memory() >> 20,
                      "by_kind_MiB": {k: v >> 10 for k, v in tot.items()},
                      "top": [(n[-30:], s >> 10, a >> 10, addr) for n, s, a, addr in top]}), flush=True)

def child(spec):
    global T0
    T0 = time.time()
    import throughput

    import mlx_tier
    from mlx_tier.job import scheduler as sch
    from mlx_tier.tools import pool_cache
    dump("start")
    orig_cfp = pool_cache.cache_for_pools
    def cfp(*a, **k):
        r = orig_cfp(*a, **k); dump("after cache_for_pools"); return r
    pool_cache.cache_for_pools = cfp
    orig_load = mlx_tier.load
    def load(*a, **k):
        r = orig_load(*a, **k); dump("after load"); return r
    mlx_tier.load = load
    orig_mp = sch.Scheduler._measured_prefix
    def mp(self, *a, **k):
        r = orig_mp(self, *a, **k); dump("after prefix"); return r
    sch.Scheduler._measured_prefix = mp
    orig_pp = sch.Scheduler._plan_pools
    def pp(self, *a, **k):
        r = orig_pp(self, *a, **k)
        dump("after plan")
        print(json.dumps({"decode_pool": r, "free_MiB": self.plan.free_bytes >> 20}), flush=True)
        os._exit(0)
    sch.Scheduler._plan_pools = pp
    throughput.worker(spec)

if __name__ == "__main__":
    if sys.argv[2] == "child":
        child(json.loads(sys.argv[3]))
    else:
        from capped import MemoryCgroup
        from pagecache import drop_pages
        model = "/tmp/throughput/synth-24"
        spec = {"schedule": "throughput", "model": model, "slots": None, "cache_gb": None, "docs": 6,
                "min_tokens": 300, "max_tokens": 700, "summary_tokens": 32, "batch1_docs": 1}
        for i in range(int(sys.argv[2])):
            drop_pages(sorted(Path(model).glob("*.safetensors")))
            with MemoryCgroup(2 * 2**30, f"throughput-bench-diag{os.getpid()}") as cg:
                p = subprocess.run(cg.wrap([sys.executable, __file__, str(BENCH), "child", json.dumps(spec)]),
                                   capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(BENCH.parent)})
            print(f"=== run {i} rc {p.returncode}", flush=True)
            print(p.stdout, flush=True)
            if p.returncode:
                print(p.stderr[-3000:], flush=True)
