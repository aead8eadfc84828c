"""Device diagnosis: which two-tier case hangs on CUDA (one case per process)."""
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, "tests")
from mlx_lm import load as mlx_load
from support.checkpoints import make_mixtral
from support.prompts import SHORT, greedy

import mlx_tier
from mlx_tier import TierConfig

case = sys.argv[1]
path = Path("/tmp/diag-moe")
if not (path / "config.json").exists():
    make_mixtral(path, Path(os.environ["MLX_TIER_TEST_TOKENIZER"]), quantized=True)
model, tok = mlx_load(str(path))
ref = greedy(model, tok, SHORT)
cfg = {"warm-off-1": dict(slots_per_layer=1, host_cache_gb=0),
       "warm-on-8": dict(slots_per_layer=8),
       "warm-on-1-cpu": dict(slots_per_layer=1, kernel="cpu"),
       "warm-on-1": dict(slots_per_layer=1)}[case]
t = time.time()
m, tk = mlx_tier.load(path, config=TierConfig(**cfg))
print(case, "loaded", flush=True)
out = greedy(m, tk, SHORT)
print(case, "equal" if out == ref else f"DIFFER {out} {ref}", round(time.time() - t, 1), "s", flush=True)
