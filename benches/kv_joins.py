"""Seconds the demo job spends where sequences join and leave its decode pool's KV cache.

Question: how much of a throughput-schedule job is the decode pool's KV cache
being rebuilt as sequences join (``extend``) and finish (``filter``)? Runs
``benches/throughput.py``'s worker (the demo, 3 of 8 slots, the throughput
schedule) with both methods of mlx-lm's ``BatchKVCache`` and of
``mlx_tier.job.pool_kv.RoomyKVCache`` timed, their results evaluated inside
the timing (so lazy copies land there: the job would pay them at its next
step instead). Prints one JSON line: documents/hour, wall seconds, and per
method its calls (one a layer) and seconds.

    python benches/kv_joins.py [--docs 32] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

sys.path.insert(0, str(Path(__file__).parent))
import throughput  # noqa: E402

from mlx_tier.job.pool_kv import RoomyKVCache  # noqa: E402

DEMO = Path.home() / ".cache/mlx-tier/smollm2-135m-moe-8x-top2-v2"


def timed_methods(spent: dict, calls: dict) -> None:
    for cls in (mlx_cache.BatchKVCache, RoomyKVCache):
        for name in ("extend", "filter"):
            def timed(self, *a, _o=cls.__dict__[name], _n=f"{cls.__name__}.{name}", **k):
                t = time.perf_counter()
                r = _o(self, *a, **k)
                if self.keys is not None:
                    mx.eval(self.keys, self.values)
                spent[_n] += time.perf_counter() - t
                calls[_n] += 1
                return r
            setattr(cls, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=32)
    ap.add_argument("--model", type=Path, default=DEMO)
    a = ap.parse_args()
    spent, calls = defaultdict(float), defaultdict(int)
    timed_methods(spent, calls)
    spec = {"schedule": "throughput", "model": str(a.model), "slots": 3, "cache_gb": None, "docs": a.docs,
            "min_tokens": 300, "max_tokens": 1500, "summary_tokens": 64, "batch1_docs": 3}
    load0 = os.getloadavg()[0]
    r = throughput.worker(spec)
    print(json.dumps({"docs": a.docs, "docs_per_hour": round(r["docs_per_hour"], 1), "wall_s": round(r["wall_s"], 1),
                      "seconds": {k: round(v, 2) for k, v in spent.items()}, "calls": dict(calls),
                      "load": [round(load0, 2), round(os.getloadavg()[0], 2)]}))


if __name__ == "__main__":
    main()
