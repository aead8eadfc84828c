"""Counts in words: singular for one, the noun's plural otherwise, thousands separated."""

import pytest

from mlx_tier.units import count_text, rate_text, tokens_text


@pytest.mark.parametrize("n, noun, text", [
    (1, "document", "1 document"), (0, "document", "0 documents"), (2, "request", "2 requests"),
    (1, "summary", "1 summary"), (3, "summary", "3 summaries"), (2, "day", "2 days"),
    (1200, "long document", "1,200 long documents"), (2, "failed request", "2 failed requests"),
])
def test_count_text(n, noun, text):
    assert count_text(n, noun) == text


def test_tokens_text():
    assert (tokens_text(1), tokens_text(16), tokens_text(1200)) == ("1 token", "16 tokens", "1,200 tokens")


@pytest.mark.parametrize("per_hour, text", [(0.04, "0.0"), (0.4, "0.4"), (0.69, "0.7"), (9.94, "9.9"), (9.96, "10"),
                                            (10.4, "10"), (2161.3, "2161")])
def test_rate_text_keeps_a_decimal_below_ten(per_hour, text):
    """A review: "predicted 0 documents/hour" for 0.4 (and "1" for 1.4) in the run's lines."""
    assert rate_text(per_hour) == text
