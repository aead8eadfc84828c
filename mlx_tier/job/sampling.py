"""How one sequence picks its tokens: greedy, or the OpenAI sampling parameters
mlx-lm implements (``mlx_lm.sample_utils``), per sequence of a batch.

Plain data, importable without MLX (a batch request file is checked before the
model loads); :meth:`Sampling.sampler` and :meth:`Sampling.processors` build
mlx-lm's objects when the engine needs them.
"""

from __future__ import annotations

from dataclasses import dataclass

WHOLE = 2**31 - 1  # a repetition context that takes every token of the sequence


@dataclass(frozen=True)
class Sampling:
    """How one sequence picks its tokens: the OpenAI sampling parameters mlx-lm has
    (``mlx_lm.sample_utils``). The defaults are plain greedy decoding.

    Attributes:
        temperature: 0 = greedy (argmax); else logits are divided by it.
        top_p: nucleus sampling's probability mass, in (0, 1]; 1 = off.
        top_k: keep the k most likely tokens; 0 = off.
        min_p: drop tokens below this fraction of the top token's probability; 0 = off.
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
        """mlx-lm's sampler for these settings (``logprobs [1, V] -> token [1]``), or
        ``None`` for greedy (the batch's shared argmax)."""
        from mlx_lm.sample_utils import make_sampler

        if self.temperature == 0:
            return None
        if self.seed is None:
            return make_sampler(self.temperature, self.top_p, self.min_p, top_k=self.top_k)
        return _seeded_sampler(self)

    def processors(self) -> list:
        """mlx-lm logits processors: the repetition penalty, when on."""
        from mlx_lm.sample_utils import make_logits_processors

        return make_logits_processors(repetition_penalty=self.repetition_penalty,
                                      repetition_context_size=self.repetition_context) \
            if self.repetition_penalty != 1.0 else []


def _seeded_sampler(s: Sampling):
    """The chain of ``mlx_lm.sample_utils.make_sampler`` (top-p, min-p, top-k, then a
    categorical draw at the temperature), drawing from its own key: ``mx.random.key(seed)``
    split ``stream + 1`` ways, then split again at every token."""
    import mlx.core as mx
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    key = [mx.random.split(mx.random.key(s.seed % 2**64), s.stream + 1)[s.stream]]

    def sample(logprobs: mx.array) -> mx.array:  # [1, V] -> [1]
        if 0 < s.top_p < 1.0:
            logprobs = apply_top_p(logprobs, s.top_p)
        if s.min_p:
            logprobs = apply_min_p(logprobs, s.min_p, 1)
        if s.top_k > 0:
            logprobs = apply_top_k(logprobs, s.top_k)
        key[0], draw = mx.random.split(key[0])
        return mx.random.categorical(logprobs * (1 / s.temperature), key=draw)

    return sample
