"""Round 19: one demo decode step of 32 sequences (benches/decode_pool.py's setup, the job's
CPU attention and dtype) under cProfile, beside the pool model's price of it from this
process's probes. Output: decode_step_profile.out.

    python decode_step_profile.py PATH/TO/benches
"""
import cProfile
import io
import pstats
import random
import sys
from dataclasses import replace

sys.path.insert(0, sys.argv[1])
from decode_pool import decode_cost  # noqa: E402

import mlx_tier  # noqa: E402
from mlx_tier.engine.dtypes import job_compute_dtype  # noqa: E402
from mlx_tier.tools import pools  # noqa: E402
from mlx_tier.tools.demo_model import ensure_demo_model  # noqa: E402

random.seed(0)
path = ensure_demo_model()
model, tok = mlx_tier.load(path, config=mlx_tier.TierConfig(slots_per_layer=3, kernel="cpu", attention_kernel=True, dtype=job_compute_dtype()))
lengths = [random.randrange(300, 1500) for _ in range(32)]
# patch: profile the timed steps
from mlx_lm.generate import GenerationBatch

orig_next = GenerationBatch.next
state = {"n": 0}
prof = cProfile.Profile()
def nxt(self):
    state["n"] += 1
    if state["n"] > 2:
        prof.enable(); r = orig_next(self); prof.disable(); return r
    return orig_next(self)
GenerationBatch.next = nxt
t = decode_cost(model, lengths, 6)
print("s per token %.4f, step %.3f" % (t, t * 32))
found = pools.shape_of(model, 0)
rates = pools.rates_for(model, found[1])
kvb = 30 * 2 * 3 * 64 * 4  # float32 KV bytes a token, all layers (30 layers, 3 KV heads of 64)
shape = replace(found[0], kv_bytes=kvb)
ctx = sum(lengths) / len(lengths)
parts = pools.layer_step_seconds(shape, rates, 32, ctx)
print("model layer parts", {k: round(v * 1e3, 2) for k, v in parts.items()}, "x", shape.layers, "head ms %.1f" % (pools.head_seconds(shape, rates, 32) * 1e3))
print("model step s %.3f" % (shape.layers * parts["total"] + pools.head_seconds(shape, rates, 32)))
s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(45); print(s.getvalue()[:9000])
s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25); print(s.getvalue()[:6000])
