"""The job's default settings, each defined once, in a module that imports
nothing: the CLI shows them in ``--help`` without loading MLX, and the configs
(:class:`mlx_tier.job.scheduler.GenerationConfig`, :class:`mlx_tier.job.run.JobConfig`)
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
# Prompt tokens per forward call while reading a prompt.
DEFAULT_PREFILL_STEP = 512
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

# The cache policy: LFU with dynamic aging. On every trace replayed (the demo's,
# Zipf, and routing generated to match published statistics of trained MoEs:
# benches/results/policies/NOTES.md) it is at least as good as LRU, and
# 0.2-5 points better where they differ; live decode speed is the same
# (benches/results/capped/NOTES.md).
DEFAULT_POLICY = "lfu"
# A job's CPU priority decrement (nice).
DEFAULT_NICE = 10
# Prefetch off by default: measured on the build machine by benches/prefetch.py
# (benches/results/prefetch/NOTES.md).
DEFAULT_PREFETCH = False
