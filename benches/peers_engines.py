"""One greedy generation by one engine, inside the run's (capped) process (benches/peers.py).

Not a bench itself: ``benches/peers.py`` starts ``python peers_engines.py
SPEC_JSON`` once per run, inside the memory cgroup, and reads the JSON events
this prints on stdout, one per line:
``{"phase": "loading"}``, ``{"phase": "generating", "load_s": ...}``,
``{"phase": "progress", "tokens": n, "ttft": s, "decode_s": s}`` (after the
first token, then every 8; a run killed for time still says how far it got),
``{"phase": "done", "result": {...}}``.

Every engine gets the same prompt token ids and decodes exactly
``max_tokens`` tokens greedily (argmax; end-of-sequence tokens are not
stopped at). TTFT = from the prompt handed over to the first token out (load
excluded); decode tok/s = the tokens after the first / their wall time.

Engines:
- ``mlx-tier``: ``mlx_tier.load`` with ``TierConfig(cache_gb, kernel)``,
  mlx-lm's ``generate_step``.
- ``mlx-lm``: ``mlx_lm.load`` fully resident, float32 (the compute dtype
  mlx-tier uses on the CPU backend, so invariant 1's comparison), the same
  ``generate_step``.
- ``nunspark``: the calls ``nunspark generate PACKED --budget B`` makes
  (``StreamingEngine`` + ``nunspark.generate.stream_generate``, its defaults:
  prefetch and expert prefetch on, wired limit requested), timed per token
  here because its CLI reports one tok/s over prefill and decode together.
- ``llama.cpp`` / ``llama.cpp repack``: ``llama_cpp.Llama`` on the GGUF
  (mmap, ``n_threads`` = CPU count), greedy ``Llama.generate``; ``repack``
  keeps llama.cpp's default (Q4_0 weights repacked into interleaved CPU
  layouts at load, ``use_extra_bufts``), the other turns it off (what
  ``llama-cli --no-repack`` does; ``llama-cpp-python`` has no argument for it,
  so its default model parameters are wrapped for this call).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

PROGRESS_EVERY = 8


@dataclass(frozen=True)
class RunSpec:
    """What one run does; sent to the worker as JSON.

    Attributes:
        engine: one of ``ENGINES`` (benches/peers.py).
        model: mlx-lm checkpoint directory (mlx-tier, mlx-lm).
        prompt: prompt token ids (the checkpoint's tokenizer).
        max_tokens: tokens generated, all of them (no stop at EOS).
        cache_gb: mlx-tier's expert cache, GiB.
        tier_kernel: mlx-tier's expert kernel (``TierConfig.kernel``).
        packed: nunspark's packed directory.
        budget_bytes: nunspark's resident weight budget, bytes.
        gguf: llama.cpp's GGUF file.
        threads: llama.cpp's ``n_threads``.
    """

    engine: str
    model: str
    prompt: tuple[int, ...]
    max_tokens: int
    cache_gb: float = 0.0
    tier_kernel: str = "auto"
    packed: str = ""
    budget_bytes: int = 0
    gguf: str = ""
    threads: int = 1


def emit(**event) -> None:
    print(json.dumps(event), flush=True)


@dataclass
class Loaded:
    """An engine ready to generate: its token stream, hit counters, cleanup."""

    tokens: Iterator[int]
    counters: Callable[[], tuple[int, int]] | None = None  # (hits, misses) so far
    close: Callable[[], None] = lambda: None
    note: str = ""


def _mlx_stream(model, prompt, n: int) -> Iterator[int]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    for token, _ in generate_step(mx.array(list(prompt)), model, max_tokens=n):
        yield int(token)


def load_mlx_tier(spec: RunSpec) -> Loaded:
    import mlx_tier
    from mlx_tier import TierConfig
    from mlx_tier.engine.dtypes import job_compute_dtype
    from mlx_tier.kernels.warmup import compile_for

    # As `run` does: Numba's memory not in this process's peak (a first run's load_s holds the compile).
    compile_for(Path(spec.model), spec.tier_kernel, lambda line: print(line, file=sys.stderr))
    model, _ = mlx_tier.load(spec.model, config=TierConfig(cache_gb=spec.cache_gb, kernel=spec.tier_kernel,
                                                              dtype=job_compute_dtype()))
    cache = model.expert_cache

    def counters() -> tuple[int, int]:
        s = cache.stats.as_dict()
        return s["hits"], s["misses"]

    return Loaded(_mlx_stream(model, spec.prompt, spec.max_tokens), counters,
                  note=f"{cache.slots_per_layer} slots/layer")


def load_mlx_lm(spec: RunSpec) -> Loaded:
    import mlx.core as mx
    from mlx_lm import load

    model, _ = load(spec.model)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return Loaded(_mlx_stream(model, spec.prompt, spec.max_tokens))


def load_nunspark(spec: RunSpec) -> Loaded:
    from pathlib import Path

    from nunspark.engine import StreamingEngine
    from nunspark.generate import stream_generate
    from nunspark.manifest import Manifest

    packed = Path(spec.packed)
    engine = StreamingEngine(packed, Manifest.load(packed / "manifest.json"), budget_bytes=spec.budget_bytes)
    stream = stream_generate(engine, list(spec.prompt), max_tokens=spec.max_tokens, temp=0.0)
    return Loaded(stream, lambda: (engine.cache.hits, engine.cache.misses), engine.close,
                  note="hits: weight pieces (layer cores and experts)")


@contextlib.contextmanager
def _repack(enabled: bool):
    """llama.cpp's model defaults with ``use_extra_bufts`` (weight repacking) set to ``enabled``."""
    import llama_cpp.llama as llama_module

    lib = llama_module.llama_cpp
    original = lib.llama_model_default_params

    def params():
        p = original()
        p.use_extra_bufts = enabled
        return p

    lib.llama_model_default_params = params
    try:
        yield
    finally:
        lib.llama_model_default_params = original


def load_llama_cpp(spec: RunSpec, repack: bool) -> Loaded:
    from llama_cpp import Llama

    with _repack(repack):
        llm = Llama(model_path=spec.gguf, n_ctx=len(spec.prompt) + spec.max_tokens + 8, n_threads=spec.threads,
                    n_threads_batch=spec.threads, use_mmap=True, verbose=False)
    stream = llm.generate(list(spec.prompt), temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
    return Loaded(stream, close=llm.close)


LOADERS = {
    "mlx-tier": load_mlx_tier,
    "mlx-lm": load_mlx_lm,
    "nunspark": load_nunspark,
    "llama.cpp": lambda spec: load_llama_cpp(spec, repack=False),
    "llama.cpp repack": lambda spec: load_llama_cpp(spec, repack=True),
}


def generate(loaded: Loaded, n: int) -> dict:
    """Pull ``n`` tokens from ``loaded``; timings, tokens and decode-phase hit rate."""
    t0 = time.perf_counter()
    first = None
    start_counts = None
    out: list[int] = []
    for token in loaded.tokens:
        out.append(int(token))
        now = time.perf_counter()
        if first is None:
            first = now
            start_counts = loaded.counters() if loaded.counters else None
        if len(out) == 1 or len(out) % PROGRESS_EVERY == 0:
            emit(phase="progress", tokens=len(out), ttft=first - t0, decode_s=now - first)
        if len(out) >= n:
            break
    end = time.perf_counter()
    result = {"tokens": len(out), "ttft": first - t0, "decode_s": end - first, "token_ids": out}
    if len(out) > 1:
        result["tok_s"] = (len(out) - 1) / (end - first)
    if start_counts is not None:
        hits, misses = (a - b for a, b in zip(loaded.counters(), start_counts))
        if hits + misses:
            result["hit_rate"] = hits / (hits + misses)
    return result


def worker(spec: RunSpec) -> None:
    from mlx_tier.engine.sizes import (
        peak_rss,  # VmHWM: this process's own peak, not its parent's
    )

    emit(phase="loading")
    t0 = time.perf_counter()
    loaded = LOADERS[spec.engine](spec)
    load_s = time.perf_counter() - t0
    emit(phase="generating", load_s=load_s)
    try:
        result = generate(loaded, spec.max_tokens)
    finally:
        loaded.close()
    result.update(load_s=load_s, note=loaded.note,
                  peak_rss=peak_rss(), pid=os.getpid())
    emit(phase="done", result=result)


if __name__ == "__main__":
    fields = json.loads(sys.argv[1])
    worker(RunSpec(**{**fields, "prompt": tuple(fields["prompt"])}))
