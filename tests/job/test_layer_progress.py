"""Progress sent from inside a long prompt step shows the prompt that step reads, from
the run's first step on, advanced by the layers done."""

from __future__ import annotations

import mlx_tier.job.activity as activity
from mlx_tier.job.activity import Activity, LayerProgress, Reporter


class Seen(Reporter):
    def __init__(self):
        self.sent = []

    def working(self, a):
        self.sent.append(a)


class Progress:
    def __init__(self):
        self.files = []

    def update(self, a):
        self.files.append(a.as_dict())


def test_the_first_step_of_a_run_shows_the_prompt_it_reads(monkeypatch):
    """One 1,358-token prompt read in one 2,048-token pool step: before, nothing had been
    shown until the step ended, when the prompt was read and the file said nothing."""
    monkeypatch.setattr(activity, "LAYER_PROGRESS_SECONDS", 0.0)
    seen, progress = Seen(), Progress()
    layers = LayerProgress(seen, progress, 30, hit_rate=lambda: 0.5)
    for layer in range(30):
        layers.layer(layer, [("long", 0, 1358, 1358)])
    shown = [a.reading for a in seen.sent]
    assert shown[0] == ("long", 0, 1358) and shown[15] == ("long", 679, 1358) and shown[-1][1] < 1358
    assert [a[1] for a in shown] == sorted(a[1] for a in shown)  # only moves forward
    assert progress.files[-1]["reading"][0] == "long" and progress.files[-1]["in_flight"] == ["long"]
    assert seen.sent[-1].hit_rate == 0.5


def test_a_step_that_starts_a_new_prompt_shows_it_not_the_last_steps(monkeypatch):
    """The last step ended with "a" read to its end; this one reads "b" (and "a" is writing)."""
    monkeypatch.setattr(activity, "LAYER_PROGRESS_SECONDS", 0.0)
    seen = Seen()
    progress = Progress()
    layers = LayerProgress(seen, progress, 4)
    layers.step_done(Activity(["a"], None, [("a", 3)], 5.0, 100.0, 0.8, eta_seconds=60.0, at=123.5))
    layers.layer(2, [("b", 512, 1024, 3000)])
    a = seen.sent[-1]
    assert a.reading == ("b", 1024, 3000) and a.in_flight == ["a", "b"] and a.writing == [("a", 3)]
    assert a.eta_seconds == 60.0 and a.decode_tok_s == 5.0  # the rest is the last step's
    assert a.at == 123.5 and progress.files[-1]["measured_mono"] == 123.5  # and so is when it was measured
    layers.layer(2, [("c", 0, 100, 100), ("b", 512, 1024, 3000)])  # two prompts in one step: both being read
    assert seen.sent[-1].reading == ("b", 1024, 3000) and seen.sent[-1].also_reading == (("c", 50, 100),)
    assert progress.files[-1]["also_reading"] == [["c", 50, 100]]


def test_the_terminal_eta_counts_down_from_when_it_was_measured(monkeypatch):
    """A review: each layer update restarted the progress line's countdown from the last
    step's ETA, so it stood still through a long step."""
    from mlx_tier.cli import render

    now = [1000.0]
    monkeypatch.setattr(render.time, "monotonic", lambda: now[0])
    r = render.RichReporter()
    r.start(total=3, skipped=0)
    r.working(Activity(["a"], None, [], 1.0, 1.0, 0.5, eta_seconds=600.0, at=1000.0))
    now[0] = 1480.0
    r.working(Activity(["a"], ("a", 50, 100), [], 1.0, 1.0, 0.5, eta_seconds=600.0, at=1000.0))  # a layer's update
    assert r.eta() == 120.0
    r.working(Activity(["a"], None, [], 1.0, 1.0, 0.5, eta_seconds=100.0))  # no time given: its own
    assert r.eta() == 100.0
    r.close()


def test_at_most_one_update_every_few_seconds_and_none_for_decode_steps():
    seen = Seen()
    layers = LayerProgress(seen, Progress(), 4)
    for layer in range(4):
        layers.layer(layer, [("a", 0, 100, 100)])  # within LAYER_PROGRESS_SECONDS of the start
    layers.sent -= activity.LAYER_PROGRESS_SECONDS
    layers.layer(0, [])  # a step reading no prompt
    assert seen.sent == []
    layers.layer(1, [("a", 0, 100, 100)])
    assert len(seen.sent) == 1


def test_a_stop_asked_during_the_step_shows_and_a_documents_parts_count_once(monkeypatch):
    monkeypatch.setattr(activity, "LAYER_PROGRESS_SECONDS", 0.0)
    seen, asked = Seen(), [False]
    layers = LayerProgress(seen, Progress(), 4, stopping=lambda: asked[0])
    layers.step_done(Activity(["long"], None, [], 0.0, 0.0, 0.0))
    layers.layer(1, [("long", 0, 300, 300), ("long", 0, 200, 200)])  # two parts of one document
    asked[0] = True
    layers.layer(2, [("long", 0, 300, 300), ("long", 0, 200, 200)])
    assert seen.sent[0].in_flight == ["long"] and not seen.sent[0].stopping and seen.sent[1].stopping
