"""How one sequence picks its tokens: greedy, or the OpenAI sampling parameters (with
mlx-lm's filters, ``mlx_lm.sample_utils``, in the API's order), per sequence of a batch.

Plain data, importable without MLX (a batch request file is checked before the
model loads); :meth:`Sampling.sampler` and :meth:`Sampling.processors` build
mlx-lm's objects when the engine needs them.
"""

from __future__ import annotations

from dataclasses import dataclass

WHOLE = 2**31 - 1  # a repetition context that takes every token of the sequence


@dataclass(frozen=True)
class Sampling:
    """How one sequence picks its tokens: the OpenAI sampling parameters and vLLM's extra ones,
    applied in their order (:func:`_chain`). The defaults are plain greedy decoding.

    Attributes:
        temperature: 0 = greedy (argmax); else logits are divided by it.
        top_p: nucleus sampling's probability mass (of the tempered distribution, what
            min-p and top-k leave), in (0, 1]; 1 = off.
        top_k: keep the k most likely tokens; 0 (or the whole vocabulary) = off.
        min_p: drop tokens below this fraction of the top token's tempered probability; 0 = off.
        seed: the sequence's own random key (same seed, same logits: same tokens,
            whatever else is in the batch); ``None``: MLX's global random state.
        stream: which of the request's choices this is: choice ``i`` of a seeded
            request draws from the ``i``-th key split from the seed.
        repetition_penalty: mlx-lm's penalty (arXiv 1909.05858) on the tokens seen; 1.0 = off.
        stop: strings that end the output; the output stops before the first one.
        repetition_context: how many of the last tokens it looks at (prompt and output):
            mlx-lm's 20 (the job's documents, as ``mlx_lm.generate``), or :data:`WHOLE` (a
            batch request's, as vLLM applies it: every token of the prompt and output).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stream: int = 0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    repetition_context: int = 20

    def sampler(self):
        """The sampler for these settings (``logprobs [1, V] -> token [1]``: :func:`_chain`), or
        ``None`` for greedy (the batch's shared argmax)."""
        return None if self.temperature == 0 else _chain(self)

    def processors(self) -> list:
        """mlx-lm logits processors: the repetition penalty, when on."""
        from mlx_lm.sample_utils import make_logits_processors

        return make_logits_processors(repetition_penalty=self.repetition_penalty,
                                      repetition_context_size=self.repetition_context) \
            if self.repetition_penalty != 1.0 else []


def _chain(s: Sampling):
    """Sampling as vLLM and the OpenAI API order it: the temperature first, then min-p, top-k
    and top-p on the tempered distribution (vLLM's ``Sampler``: temperature, the argmax-invariant
    processors, ``TopKTopPSampler``), each filter mlx-lm's (``mlx_lm.sample_utils``), then a
    categorical draw. (mlx-lm's own ``make_sampler`` takes top-p before the temperature and
    top-k last: another distribution.) A seeded sequence draws from its own key,
    ``mx.random.key(seed)`` split ``stream + 1`` ways, then split again at every token; an
    unseeded one from MLX's global random state."""
    import mlx.core as mx
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    key = [mx.random.split(mx.random.key(s.seed % 2**64), s.stream + 1)[s.stream]] if s.seed is not None else None

    def sample(logprobs: mx.array) -> mx.array:  # [1, V] -> [1]
        logprobs = logprobs * (1 / s.temperature)
        if s.min_p:
            logprobs = apply_min_p(logprobs, s.min_p, 1)
        if 0 < s.top_k < logprobs.shape[-1]:  # a k of the whole vocabulary keeps every token
            logprobs = apply_top_k(logprobs, s.top_k)
        if 0 < s.top_p < 1.0:
            logprobs = apply_top_p(logprobs, s.top_p)
        if key is None:
            return mx.random.categorical(logprobs)
        key[0], draw = mx.random.split(key[0])
        return mx.random.categorical(logprobs, key=draw)

    return sample
