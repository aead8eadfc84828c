"""Misses per generated token of decode pools of P documents (their step-t experts together, as a
decode step routes them) at S slots a layer, the job's eviction policy (tinylfu), each pool from
a cold cache: a replay of trace_decode.py's trace with mlx_tier.routing.simulate.

    python sim.py OUT.npz > sim.out
"""
import sys

import numpy as np

from mlx_tier.routing.simulate import simulate_layer
from mlx_tier.routing.trace import load

tr = load(sys.argv[1])
L = tr.num_layers
# split decode records into documents (prefill records between them)
docs, cur, prev = [], None, 0
for i in range(len(tr.layer)):
    ph = tr.phase[i]
    if ph == 1:
        if cur is None: cur = [[] for _ in range(L)]
        cur[tr.layer[i]].append(tr.experts[i].tolist())
    elif cur is not None:
        docs.append(cur); cur = None
if cur is not None: docs.append(cur)
print("docs", len(docs), "tokens", [len(d[0]) for d in docs])
# per-token stickiness: fraction of a token's experts used by the previous token of the same doc
st = [len(set(d[l][t]) & set(d[l][t-1]))/len(d[l][t]) for d in docs for l in range(L) for t in range(1, len(d[l]))]
print("same doc, consecutive tokens: share of experts reused %.2f" % np.mean(st))
for P in (1, 2, 3, 6):
    pools = [docs[i:i+P] for i in range(0, len(docs), P)]
    row = []
    for S in (4, 5, 6, 8, 10, 12, 16, 24, 32):
        miss = tok = 0; distinct = []
        for pool in pools:
            T = max(len(d[0]) for d in pool)
            for l in range(L):
                seq = []
                for t in range(T):
                    u = sorted({e for d in pool if t < len(d[l]) for e in d[l][t]})
                    seq.append(u); distinct.append(len(u))
                h, a = simulate_layer(seq, "tinylfu", S, layer=l)
                miss += a - h
            tok += sum(len(d[0]) for d in pool)
        row.append(f"S{S}:{miss/tok:6.1f}")
    print(f"P={P} distinct/layer/step {np.mean(distinct):5.1f} misses per generated token: " + " ".join(row))
