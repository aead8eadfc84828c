"""The job's default settings, each defined once, in a module that imports
nothing: the CLI shows them in ``--help`` without loading MLX, and the configs
(:class:`mlx_tier.job.scheduler.GenerationConfig`, :class:`mlx_tier.job.config.JobConfig`)
take them from here; ``policy``, ``process`` and ``tiered`` re-export theirs.
"""

DEFAULT_PROMPT = (
    "Summarise the following document in three to five sentences. "
    "Say what it is, its main points, and any conclusion."
)
DEFAULT_MAX_TOKENS = 160
# Small models fall into loops under pure greedy decoding; mlx-lm's repetition
# penalty (over the last 20 tokens) breaks them. 1.0 turns it off.
DEFAULT_REPETITION_PENALTY = 1.1
# Prompt tokens per forward call while reading a prompt (the paced schedule).
DEFAULT_PREFILL_STEP = 512
# Prompt tokens of a typical document, where a plan has no documents to measure
# (`mlx-tier plan --doc-tokens`; `run` before a document's length is known).
PLAN_DOC_TOKENS = 900
# Most prompt tokens of a throughput-schedule prefill step (over its prompts) that the
# memory split sizes its workspace for; the pool model chooses up to it, the split
# shrinks it where the workspace would pass its share. On the demo, 2,048-token pools
# read prompts 1.2x faster than 512-token ones (benches/results/throughput, round 5).
DEFAULT_POOL_STEP = 2048
# Experts a round of a layer call computes with the CPU kernel when the call needs
# more experts than the layer has slots (mlx_tier.engine.cache.LayerCache.width): the
# round's experts are read into scratch slabs shared by the layers (two halves:
# the next round is read into one while this one computes), not into the slots
# one round of S at a time. A round has a fixed cost (a kernel call, its thread
# hand-offs, a host sync); at 1 slot a layer, a 256-token prompt pool of the 8 GB
# synthetic ran ~22 rounds a layer. The memory split counts the scratch and the reads
# (mlx_tier.engine.footprint.read_ahead_bytes).
ROUND_EXPERTS = 8
# How documents go through the model: "throughput" reads prompts of several
# documents in large pools and decodes many documents together, each expert read
# once per layer step for the whole pool (mlx_tier.job.pool_engine; an overnight job
# is judged in documents per hour: benches/results/throughput/NOTES.md); "paced" reads
# one prompt at a time in ~4 s steps beside at most 8 decoding (the earlier default).
SCHEDULES = ("throughput", "paced")
DEFAULT_SCHEDULE = "throughput"
# The job runner's kernel: the CPU kernel where it serves (many times faster on
# MLX's CPU backend), else MLX's ops. The library's own default
# (TierConfig.kernel) stays "mlx": its tokens equal mlx-lm's exactly.
JOB_KERNEL = "auto"
# The job runner's compute dtype on MLX's CPU backend when none is set (a name
# in mlx.core): float32, because bf16/fp16 compute is much slower there (a bf16
# demo decoded 7.5x faster in float32: benches/results/cpu-dtype/NOTES.md). Its
# tokens then equal mlx-lm's model cast to float32
# (mlx_tier.engine.dtypes.cast_model); the library's own default
# (TierConfig.dtype None) casts nothing, as mlx_lm.load. On a GPU the job keeps
# the checkpoint's dtypes.
JOB_CPU_DTYPE = "float32"

# The cache policy: W-TinyLFU (mlx_tier.policy.eviction.WTinyLFUPolicy). Replayed
# at 25/50/75% of the experts (benches/results/policies/NOTES.md, 2026-12-01): on
# trained-like routing it is at least as good as LFU with dynamic aging (the
# default before) within 0.1 point, and 1.1-3.4 points better at 25%; on a loop
# over 1.1x the cache, where LRU and LFU hit 0-62%, it hits 73-83%; on a hot set
# plus bursts of scanned experts, where LFU falls to 33-44%, it hits 85-89%, at
# least LRU's. Its bookkeeping costs about what LFU's does (5-9 us per expert
# access in the simulator, same run); live decode speed not re-measured (LFU's
# equalled LRU's, benches/results/capped/NOTES.md).
DEFAULT_POLICY = "tinylfu"
# A job's CPU priority decrement (nice).
DEFAULT_NICE = 10
# Prefetch off by default: measured on the build machine by benches/prefetch.py
# (benches/results/prefetch/NOTES.md).
DEFAULT_PREFETCH = False
# A quantized KV cache (`run --kv-bits`, mlx_tier.job.quantized_kv): the bits mx.quantize
# packs for head dims of 64 and 128, and the group (mlx-lm's QuantizedKVCache default).
KV_BITS = (4, 8)
KV_GROUP_SIZE = 64
