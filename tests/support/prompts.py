"""Prompts and greedy decoding shared by the exactness tests."""

from __future__ import annotations

from mlx_lm import generate

SHORT = "The weather today"


# > 32 tokens, so the prompt's index tensor has >= 64 entries and mlx-lm's
# SwitchGLU takes its sorted path during prefill.
LONG = (
    "In the beginning the river carried salt and silt down from the mountains, and the people who "
    "lived along its banks learned to read its moods, planting after the floods and fishing in the "
    "long dry months when the water ran clear and slow over the stones."
)


def greedy(model, tokenizer, prompt, n=12):
    return generate(model, tokenizer, prompt, max_tokens=n, verbose=False)
