"""Round 19: the CPU attention's decode-pool KV read rate, one cache reread (as
probe_rates measures it) against 30 distinct layers' caches read in turn (from memory, as a
pool's step reads them), at the demo's and the synthetic's head shapes. It rejected the
hypothesis that the probe reads from the last-level cache: the distinct caches read no slower.

    python kv_read_rate.py
"""
import time

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from mlx_tier.kernels.cpu_attention import sdpa


def rate(seqs, heads, kv_heads, n, d, layers):
    one = mx.random.normal((seqs, heads, 1, d))
    kv = [(mx.random.normal((seqs, kv_heads, n, d)), mx.random.normal((seqs, kv_heads, n, d))) for _ in range(layers)]
    mask = create_causal_mask(1, offset=n - 1, left_padding=mx.zeros((seqs,), mx.int32))
    mx.eval(one, kv, mask)
    for k, v in kv: sdpa(one, k, v, 0.1, mask)
    ts = []
    for rep in range(5):
        t0 = time.perf_counter()
        for k, v in kv: sdpa(one, k, v, 0.1, mask)
        ts.append((time.perf_counter() - t0) / layers)
    t = sorted(ts)[2]
    b = kv[0][0].nbytes * 2
    return b / 2**20, b / t / 1e9

for name, h, hk, d in (("demo", 9, 3, 64), ("synth", 32, 4, 128)):
    for seqs, n in ((8, 1024), (32, 1685), (5, 700)):
        for layers in (1, 30):
            mb, g = rate(seqs, h, hk, n, d, layers)
            print(f"{name} seqs {seqs} keys {n} layers {layers}: {mb:.1f} MiB/layer, {g:.1f} GB/s", flush=True)
