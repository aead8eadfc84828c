"""One expert block through the CPU kernel: milliseconds a call, and its output.

Question: does a change to the CPU expert kernel make one block's call faster at
a given shape (the demo's 2,048-token prompt pool: ``--hidden 576 --inner 1536
--experts 8 --top-k 2 --tokens 2048``; the synthetic's: ``2048 768 128 8``)?
A random 4-bit SwitchGLU (group size 64, float32, seed 0) on random rows, each
token's experts distinct and random; one untimed call, then ``--calls`` timed,
the median and the least printed. ``--save`` writes the output (``.npy``) to
compare two versions of the code run one after the other:

    PYTHONPATH=OLD python benches/expert_block.py --save old.npy   # alternate with
    PYTHONPATH=NEW python benches/expert_block.py --save new.npy
"""

from __future__ import annotations

import argparse
import json
import os
import time

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx_lm.models.switch_layers import SwitchGLU


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=576, help="model width D")
    ap.add_argument("--inner", type=int, default=1536, help="an expert's hidden width H")
    ap.add_argument("--experts", type=int, default=8, help="experts (all resident)")
    ap.add_argument("--top-k", type=int, default=2, help="experts per token")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens a call")
    ap.add_argument("--calls", type=int, default=7, help="timed calls")
    ap.add_argument("--save", default=None, help="write the output here (.npy)")
    a = ap.parse_args()

    from mlx_tier.kernels import cpu

    mx.random.seed(0)
    block = SwitchGLU(a.hidden, a.inner, a.experts)
    nn.quantize(block, group_size=64, bits=4)
    block.set_dtype(mx.float32)
    x = mx.random.normal((a.tokens, a.hidden))
    mx.eval(block.parameters(), x)
    rng = np.random.default_rng(0)
    slots = mx.array(np.stack([rng.permutation(a.experts)[: a.top_k] for _ in range(a.tokens)]).astype(np.int32))
    y = cpu.expert_forward(block, x, slots)
    if a.save:
        np.save(a.save, np.array(y))
    times = []
    for _ in range(a.calls):
        t = time.perf_counter()
        cpu.expert_forward(block, x, slots)
        times.append(time.perf_counter() - t)
    print(json.dumps({"shape": [a.hidden, a.inner, a.experts, a.top_k, a.tokens], "threads": cpu.THREADS,
                      "load": [round(v, 1) for v in os.getloadavg()],
                      "median_ms": round(sorted(times)[len(times) // 2] * 1e3, 1),
                      "min_ms": round(min(times) * 1e3, 1)}))


if __name__ == "__main__":
    main()
