"""Reading the CLI's output as a user does."""

from __future__ import annotations

import pytest

WIDTH = 80  # a terminal's columns


@pytest.fixture
def eighty_columns(monkeypatch):
    """The CLI's consoles at :data:`WIDTH` columns, whatever the test's terminal."""
    import mlx_tier.cli.render as render

    for console in (render.err, render.out):
        monkeypatch.setattr(console, "_width", WIDTH)


def command_after(output: str, label: str) -> str:
    """The command a message gives after ``label`` (e.g. ``"Resume with:"``): the line
    after the word-wrapped prose that ends with it (:func:`mlx_tier.messages.with_command`).

    Raises:
        AssertionError: no line ends the label.
    """
    lines = output.splitlines()
    for i, line in enumerate(lines[:-1]):
        if " ".join(" ".join(lines[: i + 1]).split()).endswith(label) and line.rstrip().endswith(label.split()[-1]):
            return lines[i + 1]
    raise AssertionError(f"no {label!r} followed by a command in:\n{output}")
