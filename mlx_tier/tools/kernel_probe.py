"""How fast a run of a checkpoint would go here: the expert kernel it would use and
the disk read as it reads, each measured briefly, and the rates they predict.

- The kernel: one expert block of the checkpoint's shape (``SwitchGLU`` of
  D x I, quantized as the experts are) computed by the kernel a run chooses
  (:func:`mlx_tier.kernels.registry.choose`: the CPU kernel on MLX's CPU
  backend); decode as one token x top-k experts (GB/s of expert weights),
  a prompt step as T tokens x top-k over the layer's experts (GFLOP/s). The
  probe block holds at most :data:`PROBE_EXPERTS` experts and its prompt step
  keeps the checkpoint's rows per expert (T x k / E), so its time scales to a
  whole layer.
- The disk: the experts' own byte ranges read with :class:`~mlx_tier.engine.store.ExpertStore`
  (positioned reads on its thread pool, as a run's misses), top-k experts of a
  random layer at a time, their pages dropped first (Linux, macOS: ``posix_fadvise``
  where there is one).
- A layer's own work (:class:`LayerProbe`): norm, attention projections and
  scores, router, one evaluation as a tiered run evaluates each layer.
- The rates (:func:`predict`): a decode step of B sequences takes
  ``missed bytes / disk + (touched expert bytes + output layer) / kernel + layers x layer``;
  a prompt step of T tokens ``missed bytes / disk + layers x T x k x 6 D I / kernel FLOP/s
  + layers x layer(T)``; the expert counts from uniform routing
  (touched = E (1 - (1 - 1/E)^(B k)), a miss each with probability 1 - hit rate).
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import asdict, dataclass

import mlx.core as mx
import numpy as np
from mlx import nn

from mlx_tier.engine.footprint import ModelShape
from mlx_tier.units import significant

PROBE_EXPERTS = 16  # experts in the probe block: enough rows per expert, bounded memory
DECODE_CONTEXT = 256  # cached tokens a decode step's attention reads in the layer probe
REPS = 9  # decode calls timed (median); the prompt step is timed once


@dataclass(frozen=True)
class KernelRates:
    """What the expert kernel did on the probe block.

    Attributes:
        kernel: ``"cpu"``, ``"mlx"`` or ``"metal"``.
        decode_gbps: expert weight bytes per second (1e9) of a decode step.
        prompt_gflops: FLOP/s (1e9) of a prompt step.
        prompt_tokens: T of the prompt step measured.
    """

    kernel: str
    decode_gbps: float
    prompt_gflops: float
    prompt_tokens: int
    layer_decode_s: float = 0.0  # a layer's work outside the experts, one token (:func:`measure_layer`)
    layer_prompt_s: float = 0.0  # the same for a prompt step of prompt_tokens tokens

    def as_dict(self) -> dict:
        return asdict(self)


def probe_block(shape: ModelShape, experts: int, quant: dict | None) -> nn.Module:
    """A random ``SwitchGLU`` of the checkpoint's expert shape with ``experts`` experts,
    quantized like ``quant`` (``{"bits", "group_size", "mode"}``; ``None``: float32)."""
    return quantized_glu(shape.hidden, shape.expert_inner, experts, quant)


def quantized_glu(hidden: int, inner: int, experts: int, quant: dict | None, dtype=mx.float32) -> nn.Module:
    """A random mlx-lm ``SwitchGLU`` (``hidden`` -> ``inner`` -> ``hidden``) of ``experts``
    experts, quantized like ``quant`` (``{"bits", "group_size", "mode"}``; ``None``: not),
    its floating leaves in ``dtype`` (float32: as a run computes on the CPU backend).

    Raises:
        ValueError: a quantization MLX refuses (bits, group size and mode that do not go together).
    """
    from mlx_lm.models.switch_layers import SwitchGLU

    block = SwitchGLU(hidden, inner, experts)
    if quant:
        nn.quantize(block, group_size=quant["group_size"], bits=quant["bits"], mode=quant.get("mode", "affine"))
    block.set_dtype(dtype)
    mx.eval(block.parameters())
    return block


def _median_seconds(call, reps: int) -> float:
    """Median seconds of ``reps`` evaluations of ``call()``, after one that compiles and
    warms the caches."""
    mx.eval(call())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(call())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _time(kernel, block, x: mx.array, slots: mx.array, reps: int) -> float:
    """Median seconds of ``reps`` kernel calls (:func:`_median_seconds`)."""
    return _median_seconds(lambda: kernel(block, x, slots), reps)


def measure_kernel(shape: ModelShape, quant: dict | None, kernel: str, prompt_tokens: int = 128,
                   reps: int = REPS) -> KernelRates:
    """Time ``kernel`` on a probe block (module doc).

    Raises:
        ValueError: an unknown kernel, or one not available here.
    """
    from mlx_tier.kernels.registry import kernel_for

    fn = kernel_for(kernel)
    n = min(shape.experts, PROBE_EXPERTS)
    block = probe_block(shape, n, quant)
    expert_bytes = sum(v.nbytes for _, v in nn.utils.tree_flatten(block.parameters())) / n
    rng = np.random.default_rng(0)
    k = min(shape.top_k, n)
    slots = mx.array(rng.permutation(n)[:k][None].astype(np.uint32))
    decode = _time(fn, block, mx.random.normal((1, shape.hidden)), slots, reps)
    t = max(1, round(prompt_tokens * n / shape.experts))  # the checkpoint's rows per expert
    picks = np.stack([rng.permutation(n)[:k] for _ in range(t)]).astype(np.uint32)
    prompt = _time(fn, block, mx.random.normal((t, shape.hidden)), mx.array(picks), 1)
    flops = 2 * t * k * 3 * shape.hidden * shape.expert_inner
    layer = LayerProbe(shape, quant, kernel)
    return KernelRates(kernel, k * expert_bytes / decode / 1e9, flops / prompt / 1e9, prompt_tokens,
                       layer.seconds(1, DECODE_CONTEXT, reps), layer.seconds(prompt_tokens, 0, 1))


class LayerProbe(nn.Module):
    """A decoder layer's work outside its experts, with random weights of the checkpoint's
    shapes: norm, q/k/v/o projections (quantized like the experts; through the CPU kernel
    where a run serves its dense layers so), attention over a context, the router and its
    top-k. A tiered run evaluates each layer on its own (the router's choice must reach
    the host), so a layer's time is one evaluation of this."""

    def __init__(self, shape: ModelShape, quant: dict | None, kernel: str):
        super().__init__()
        s = self.shape = shape
        self.norm = nn.RMSNorm(s.hidden)
        self.q = nn.Linear(s.hidden, s.heads * s.head_dim, bias=False)
        self.k = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.v = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.o = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False)
        self.router = nn.Linear(s.hidden, s.experts, bias=False)
        if quant:
            nn.quantize(self, group_size=quant["group_size"], bits=quant["bits"], mode=quant.get("mode", "affine"),
                        class_predicate=lambda path, m: isinstance(m, nn.Linear) and path != "router")
        self.set_dtype(mx.float32)
        mx.eval(self.parameters())
        if kernel == "cpu" and quant:
            from mlx_tier.kernels.cpu_dense import serve_dense

            serve_dense(self)

    def __call__(self, x: mx.array, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        s, (B, T, _) = self.shape, x.shape
        h = self.norm(x)
        q = self.q(h).reshape(B, T, s.heads, s.head_dim).transpose(0, 2, 1, 3)
        k = mx.concatenate([keys, self.k(h).reshape(B, T, s.kv_heads, s.head_dim).transpose(0, 2, 1, 3)], axis=2)
        v = mx.concatenate([values, self.v(h).reshape(B, T, s.kv_heads, s.head_dim).transpose(0, 2, 1, 3)], axis=2)
        a = mx.fast.scaled_dot_product_attention(q, k, v, scale=s.head_dim ** -0.5, mask="causal" if T > 1 else None)
        x = x + self.o(a.transpose(0, 2, 1, 3).reshape(B, T, -1))
        gates = mx.softmax(self.router(self.norm(x)), axis=-1)
        return x, mx.argpartition(-gates, kth=s.top_k - 1, axis=-1)[..., : s.top_k]

    def seconds(self, tokens: int, context: int, reps: int) -> float:
        """Median seconds of one evaluation for ``tokens`` new tokens over ``context`` cached ones."""
        s = self.shape
        x = mx.random.normal((1, tokens, s.hidden))
        cached = mx.random.normal((1, s.kv_heads, context, s.head_dim))
        mx.eval(x, cached)
        return _median_seconds(lambda: self(x, cached, cached), reps)


def measure_expert_reads(store, layers: list[list[str]], top_k: int, total_mb: int = 64, seed: int = 0) -> float:
    """GB/s of reading top-k experts of random layers as a run reads its misses.

    Args:
        store: an :class:`~mlx_tier.engine.store.ExpertStore` of the checkpoint.
        layers: per MoE layer, the names of its stacked expert tensors.
        top_k: experts read together.
        total_mb: MiB to read in all.
    """
    rng = random.Random(seed)
    done, seconds = 0, 0.0
    while done < total_mb * 2**20:
        names = rng.choice(layers)
        e = store.info(names[0]).shape[0]
        experts = rng.sample(range(e), min(top_k, e))
        _drop_pages(store, names, experts)
        t0 = time.perf_counter()
        got = store.read_experts(names, experts)
        seconds += time.perf_counter() - t0
        done += sum(a.nbytes for a in got.values())
    return done / seconds / 1e9 if seconds else 0.0


def _drop_pages(store, names: list[str], experts: list[int]) -> None:
    """Evict the byte ranges of ``experts`` from the page cache, where the OS lets us."""
    if not hasattr(os, "posix_fadvise"):
        return
    for name in names:
        info = store.info(name)
        size = info.expert_nbytes()
        fd = os.open(info.file, os.O_RDONLY)
        try:
            for e in experts:
                os.posix_fadvise(fd, info.start + e * size, size, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def touched(experts: int, picks: float) -> float:
    """Expected distinct experts among ``picks`` uniform picks of ``experts``."""
    return experts * (1 - (1 - 1 / experts) ** picks) if experts else 0.0


@dataclass(frozen=True)
class Predicted:
    """Rates a run would reach (tokens per second, all sequences together)."""

    decode_tok_s: float
    prompt_tok_s: float
    hit_rate: float
    batch: int
    prompt_step: int

    def as_dict(self) -> dict:
        return {k: significant(v) if isinstance(v, float) else v for k, v in asdict(self).items()}


def quant_of(leaf: nn.Module) -> dict | None:
    """How a (Quantized)SwitchLinear is quantized (``{"bits", "group_size", "mode"}``), ``None`` if not."""
    bits = getattr(leaf, "bits", None)
    if bits is None:
        return None
    return {"bits": bits, "group_size": leaf.group_size, "mode": getattr(leaf, "mode", "affine")}


def predict(shape: ModelShape, layers: int, expert_disk: int, rates: KernelRates, disk_gbps: float,
            hit_rate: float, batch: int = 1, prompt_step: int = 512) -> Predicted:
    """Decode and prompt rates from the measured kernel and disk (module doc).

    Args:
        shape: the checkpoint's sizes; ``layers``: its MoE layers.
        expert_disk: bytes of one expert on disk (what a miss reads; about what the kernel streams).
        rates: :func:`measure_kernel`; disk_gbps: :func:`measure_expert_reads` (or a run's own).
        hit_rate: the expert cache's, in [0, 1].
        batch: sequences of a decode step; prompt_step: tokens of a prompt step.
    """
    def step_seconds(picks: float, tokens: int) -> float:
        t = touched(shape.experts, picks) * layers
        io = (1 - hit_rate) * t * expert_disk / (disk_gbps * 1e9) if disk_gbps > 0 else 0.0
        if not tokens:  # the output layer once per step (quantized as the experts), each layer's own work
            head = shape.vocab * shape.hidden * expert_disk / (3 * shape.hidden * shape.expert_inner)
            return io + (t * expert_disk + head) / (rates.decode_gbps * 1e9) + shape.layers * rates.layer_decode_s
        experts = layers * tokens * shape.top_k * 6 * shape.hidden * shape.expert_inner
        own = shape.layers * rates.layer_prompt_s * tokens / max(1, rates.prompt_tokens)
        return io + experts / (rates.prompt_gflops * 1e9) + own

    decode = batch / step_seconds(batch * shape.top_k, 0)
    prompt = prompt_step / step_seconds(prompt_step * shape.top_k, prompt_step)
    return Predicted(decode, prompt, hit_rate, batch, prompt_step)
