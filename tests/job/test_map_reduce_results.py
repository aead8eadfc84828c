"""What a long document's summary is made of: each call's result as the model wrote it,
cut to its last whole sentence once, and no part left out of the summary unsaid.

The calls' outputs are scripted (the scheduler's handling of finished calls, fed what a
model might write), so each case is exact whatever the tiny model would generate."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import pytest

import mlx_tier
from mlx_tier.job.documents import Document
from mlx_tier.job.scheduler import GenerationConfig, Scheduler, _Doc
from mlx_tier.outdir.parts import PartStore

LONG = "\n\n".join(f"Paragraph {i}: the {i}th bridge crosses the river at mile {i * 7}." for i in range(40))
CUT = "Sales rose. It peaked in 2019. Later it fell to"  # cut by the token limit
TRIMMED = "Sales rose. It peaked in 2019."  # its last whole sentence ends with a number's dot
IDENTITY = {"model": "tiny", "kernel": "mlx"}


@pytest.fixture(scope="module")
def tiered(tiny_moe):
    return mlx_tier.load(tiny_moe, config=mlx_tier.TierConfig(slots_per_layer=2))


def scheduler(tiered, path, store=None, context=180):
    model, tokenizer = tiered
    return Scheduler(model, tokenizer, path, context, GenerationConfig("Summarise this.", max_tokens=8),
                     parts=store)


def summarise(sched, text, write):
    """The outcomes of one document whose calls finish with ``write(level, index, calls)``
    -> ``(text, finish reason)``, a level's calls all in one step; also the calls made."""
    d = _Doc(Document("doc", "doc", text), 0.0)
    started = sched._start(d)
    if not isinstance(started, list):
        return [started], []
    ready, outcomes, made = deque(started), [], []
    while ready:
        calls = list(ready)
        ready.clear()
        level = d.mr.level if d.mr else 0
        made += [(level, t.key[1]) for t in calls]
        finished = []
        for t in calls:
            out, reason = write(level, t.key[1], len(calls))
            finished.append(SimpleNamespace(key=t.key, text=out, finish_reason=reason, tokens=[1, 2, 3]))
        outcomes += list(sched._take_finished(finished, ready))
    return outcomes, made


def final_cut(level, index, calls):
    """Every part summarised whole; the combining call cut by the limit."""
    return (CUT, "length") if level > 0 else (f"Part {index} was read.", "stop")


def test_a_long_documents_summary_cut_by_the_limit_is_trimmed_once(tiered, tiny_moe, tmp_path):
    (out,), made = summarise(scheduler(tiered, tiny_moe, PartStore(tmp_path, IDENTITY)), LONG, final_cut)
    assert out.status == "done" and out.parts >= 3 and out.summary == TRIMMED  # was "Sales rose."
    (short,), _ = summarise(scheduler(tiered, tiny_moe), "A short text.", lambda *a: (CUT, "length"))
    assert short.summary == TRIMMED  # the same output of a document in one call
    # resumed with every call kept: the kept final result is the summary, as it was
    (again,), made_again = summarise(scheduler(tiered, tiny_moe, PartStore(tmp_path, IDENTITY)), LONG, final_cut)
    assert made_again == [] and again.summary == TRIMMED and again.kept == len(made)


@pytest.mark.parametrize("cut", ["It moved to the U.S. Then it hired", "Revenue grew 4.8. Costs were cut by a thi"])
def test_other_cut_summaries_are_trimmed_once(tiered, tiny_moe, cut):
    (out,), _ = summarise(scheduler(tiered, tiny_moe), LONG,
                          lambda level, i, n: (cut, "length") if level else ("Read.", "stop"))
    (short,), _ = summarise(scheduler(tiered, tiny_moe), "A short text.", lambda *a: (cut, "length"))
    assert out.summary == short.summary != ""


def test_a_part_with_no_summary_fails_the_document_instead_of_being_left_out(tiered, tiny_moe, tmp_path):
    def third_empty(level, index, calls):  # e.g. a reasoning model's limit spent in its reasoning
        return ("", "length") if (level, index) == (0, 2) else (f"Part {index} was read.", "stop")

    first = PartStore(tmp_path, IDENTITY)
    outcomes, made = summarise(scheduler(tiered, tiny_moe, first), LONG, third_empty)
    parts = sum(level == 0 for level, _ in made)
    assert [o.status for o in outcomes] == ["failed"] and all(level == 0 for level, _ in made)  # nothing combined
    assert f"no summary of part 3 of {parts} within `max_tokens` 8" in outcomes[0].error
    assert "`retry_failed`" in outcomes[0].error
    # the empty call is kept, its tokens counted in the run's (3 a call here), but not reused:
    # a retry writes it again
    assert first.written_now() == {"doc": 3 * parts}
    store = PartStore(tmp_path, IDENTITY)
    assert store.docs({"doc": None}) == {"doc": parts - 1}
    (retried,), made_again = summarise(scheduler(tiered, tiny_moe, store), LONG, final_cut)
    assert retried.status == "done" and retried.kept == parts - 1 and (0, 2) in made_again


def test_a_part_the_model_ended_empty_is_not_blamed_on_the_token_limit(tiered, tiny_moe):
    outcomes, _ = summarise(scheduler(tiered, tiny_moe), LONG,
                            lambda level, i, n: ("", "stop") if (level, i) == (0, 1) else ("Read.", "stop"))
    assert [o.status for o in outcomes] == ["failed"] and "max_tokens" not in outcomes[0].error
    assert "no summary of part 2 of" in outcomes[0].error and "ended its answer without one" in outcomes[0].error
    (short,), _ = summarise(scheduler(tiered, tiny_moe), "A short text.", lambda *a: ("", "stop"))
    assert short.status == "failed" and "ended its answer without one" in short.error


def test_an_empty_combining_call_fails_the_document_too(tiered, tiny_moe):
    """Part results too long to combine at once are combined in groups first; an empty group
    result would drop those parts from the summary."""
    wordy = " ".join(["The bridge crosses the river near the old mill."] * 2)

    def second_group_empty(level, index, calls):
        if level == 0:
            return wordy, "stop"
        return ("", "length") if (level, index, calls > 1) == (1, 1, True) else ("Combined.", "stop")

    outcomes, made = summarise(scheduler(tiered, tiny_moe), LONG, second_group_empty)
    groups = sum(level == 1 for level, _ in made)
    assert groups >= 2  # the case: combined in groups
    assert [o.status for o in outcomes] == ["failed"]
    assert f"no summary of combining call 2 of {groups} within" in outcomes[0].error
