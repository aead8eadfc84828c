"""Record the routing of each bench document decoded alone (batch 1, the CPU kernel, 16 slots a
layer, no cap): the trace sim.py replays at other slot counts and pool sizes (routing does not
depend on the cache).

    python trace_decode.py SYNTH OUT.npz DOCS TOKENS      # round 20: SYNTH 6 32
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benches"))
from mlx_lm.utils import load_tokenizer
from throughput import documents

import mlx_tier
from mlx_tier import TierConfig
from mlx_tier.defaults import (
                       DEFAULT_PREFILL_STEP,
                       DEFAULT_PROMPT,
                       DEFAULT_REPETITION_PENALTY,
)
from mlx_tier.engine.checkpoint import context_length
from mlx_tier.engine.dtypes import job_compute_dtype
from mlx_tier.job.model_setup import FALLBACK_CONTEXT
from mlx_tier.job.scheduler import GenerationConfig, Scheduler
from mlx_tier.routing.trace import save

model_dir = Path(sys.argv[1]); out = sys.argv[2]; n = int(sys.argv[3]); gen_tokens = int(sys.argv[4])
tier = TierConfig(slots_per_layer=16, kernel="cpu", attention_kernel=True, dtype=job_compute_dtype())
docs = documents(load_tokenizer(model_dir), n, 300, 700)
model, tok = mlx_tier.load(model_dir, config=tier)
gen = GenerationConfig(DEFAULT_PROMPT, gen_tokens, DEFAULT_REPETITION_PENALTY, schedule="throughput",
                       batch_size=1, prefill_batch=1, prefill_step_size=DEFAULT_PREFILL_STEP)
s = Scheduler(model, tok, model_dir, context_length(model_dir, FALLBACK_CONTEXT), gen, max(len(d.text) for d in docs),
              typical_chars=700*4, documents=len(docs))
rec = model.expert_cache.start_trace("synth batch1 decode")
t = time.time()
outs = list(s.run(docs, on_step=lambda info, ids: None))
tr = model.expert_cache.stop_trace()
print("docs", len(outs), "s", round(time.time()-t, 1), "records", len(tr.layer), "decode", int((tr.phase == 1).sum()))
save(tr, out)
