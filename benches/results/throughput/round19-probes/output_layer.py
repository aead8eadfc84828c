"""Round 19: the demo model's output layer (its tied 8-bit embedding) timed alone at 1-64 rows
(one position a sequence, as a decode step runs it), beside the pool model's loops and GEMM
prices from this process's probes.

    python output_layer.py
"""
import json
import time

import mlx.core as mx

import mlx_tier
from mlx_tier.engine.dtypes import job_compute_dtype
from mlx_tier.tools import pools
from mlx_tier.tools.demo_model import ensure_demo_model

path = ensure_demo_model()
model, tok = mlx_tier.load(path, config=mlx_tier.TierConfig(slots_per_layer=3, kernel="cpu", dtype=job_compute_dtype(), attention_kernel=True))
emb = model.model.embed_tokens
print(type(emb).__name__, emb["weight"].shape, emb["weight"].dtype, getattr(emb, "bits", None), getattr(emb, "group_size", None))
nbytes = sum(v.nbytes for k, v in emb.parameters().items())
print("head MB", nbytes / 1e6)
for B in (1, 5, 8, 16, 32, 64):
    x = mx.random.normal((B, 1, 576)); mx.eval(x)
    for _ in range(2): mx.eval(emb.as_linear(x))
    ts = []
    for _ in range(7):
        t0 = time.perf_counter(); mx.eval(emb.as_linear(x)); ts.append(time.perf_counter() - t0)
    print(B, "ms %.2f" % (sorted(ts)[3] * 1e3))
found = pools.shape_of(model, 1.0)
r = pools.rates_for(model, found[1])
print(json.dumps(r.as_dict()))
for B in (1, 5, 8, 16, 32, 64):
    print(B, "pair-priced ms %.2f" % (B * r.pair_seconds(nbytes, B) * 1e3), "gemm-priced ms %.2f" % (B * 2 * 49152 * 576 / r.gemm_gflops / 1e6))
