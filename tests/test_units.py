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


@pytest.mark.parametrize("per_hour, text", [(0.04, "0.04"), (0.4, "0.4"), (0.69, "0.7"), (9.94, "9.9"), (9.96, "10"),
                                            (10.4, "10"), (2161.3, "2161")])
def test_rate_text_keeps_a_decimal_below_ten(per_hour, text):
    """A review: "predicted 0 documents/hour" for 0.4 (and "1" for 1.4) in the run's lines."""
    assert rate_text(per_hour) == text


def test_shares_sizes_and_small_rates_never_round_to_what_they_are_not():
    """A review: a hit rate of 99.6% read "hit 100%", 216 KiB read "read 0 MiB", and 0.04
    documents/hour "0.0"."""
    from mlx_tier.units import mib_text, percent_text, rate_text

    assert [percent_text(f) for f in (0, 0.366, 0.99, 0.994, 0.996, 0.9996, 1, 0.004, 0.0004, 0.0104)] == \
        ["0%", "37%", "99.0%", "99.4%", "99.6%", "99.9%", "100%", "0.4%", "<0.1%", "1%"]
    assert [mib_text(n) for n in (0, 100, 221_184, 2**20 - 1, 2**20, 5 * 2**20 + 1)] == \
        ["0 MiB", "1 KiB", "216 KiB", "1 MiB", "1 MiB", "5 MiB"]
    assert percent_text(float("nan")) == "?"
    assert [rate_text(r) for r in (0, 0.04, 0.0004, 0.05, 0.69, 9.96, 212.4)] == \
        ["0.0", "0.04", "0.0004", "0.1", "0.7", "10", "212"]


def test_figures_written_to_json_keep_their_magnitude():
    """A user trial: `plan --doc-tokens 999999999999999 --json` wrote "docs_per_hour": 0.0,
    the plan's figures rounded to two decimals; they keep four significant digits."""
    import dataclasses

    from mlx_tier.tools.pools import Rates
    from mlx_tier.units import significant

    assert [significant(v) for v in (151.2372, 1.234567e-9, 0.0, 123456.7, 2.5e-5)] == \
        [151.2, 1.235e-9, 0.0, 123500.0, 2.5e-5]
    assert significant(float("inf")) == float("inf")
    rates = dataclasses.replace(Rates(1, 2, 3, 4, 5), per_expert_s=2.5e-5)
    assert rates.as_dict()["per_expert_s"] == 2.5e-5  # was 0.0


def test_hit_rates_are_never_rounded_to_100_percent_anywhere():
    """A review: the final line, each document's line and `status` gave 99.996% as "hit rate
    100.0%" (``.1%``), the progress line "99.9%", `plan` and the page "100%" for 255 of 256
    slots: every hit rate now goes through one rounding."""
    from mlx_tier.cli.render import _hit_text
    from mlx_tier.units import percent_text

    assert [percent_text(f, 1) for f in (0, 0.366, 0.999, 0.99996, 1, 0.00004, 0.0009)] == \
        ["0.0%", "36.6%", "99.90%", "99.99%", "100.0%", "<0.01%", "0.09%"]
    assert _hit_text({"hits": 99996, "misses": 4, "hit_rate": 0.99996}) == "hit rate 99.99%"
    assert percent_text(255 / 256) == "99.6%"


def test_given_rates_never_show_as_zero():
    """A trial: `plan demo --disk-gbps 1e-12` showed "0.00 GB/s (given)"."""
    from mlx_tier.units import decimal_text

    assert [decimal_text(v) for v in (0.57, 12.3456, 1e-12, 0.004, 0.005, 0)] == \
        ["0.57", "12.35", "1e-12", "0.004", "0.01", "0.00"]
