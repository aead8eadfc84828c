"""The README's Python example works as written: it applies the chat template, so the
demo model answers (without it, the first token is end-of-sequence and it prints
nothing), and what it prints is a sentence on the question asked.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_example() -> str:
    section = README.read_text().split("## Python API", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_the_example_applies_the_chat_template():
    code = python_example()
    assert "apply_chat_template" in code and "mlx_tier.load(" in code


@pytest.mark.slow
def test_the_readme_python_example_prints_an_answer(demo_model, tmp_path):
    env = {**os.environ, "MLX_TIER_CACHE": os.environ["MLX_TIER_CACHE"]}  # the demo built by the fixture
    r = subprocess.run([sys.executable, "-c", python_example()], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr
    answer, stats = r.stdout.strip().rsplit("\n", 1)
    words = re.findall(r"[A-Za-z']+", answer)
    assert len(words) >= 8, answer  # a sentence, not an empty string
    assert {"sky", "blue", "light", "sun", "sunlight", "scattering", "atmosphere"} & {w.lower() for w in words}, answer
    assert "'hit_rate'" in stats


def test_run_help_names_every_exit_code_of_the_readme_and_docs():
    """A user trial: `mlx-tier run --help` left out 141, which the README and docs/cli.md list."""
    from typer.testing import CliRunner

    from mlx_tier.cli.main import app

    text = " ".join(CliRunner().invoke(app, ["run", "--help"], terminal_width=200).output.split())
    said = text.split("Exit codes: ", 1)[1].split(". ", 1)[0]  # "0 all done, 1 some documents failed, ..."
    listed = re.findall(r"(?:^|, )(\d+) [a-z]", said)
    for doc in (README, README.parent / "docs" / "cli.md"):
        table = re.split(r"^\| (?:exit )?code \| meaning \|$", doc.read_text(), maxsplit=1, flags=re.M)[1]
        codes = re.findall(r"^\| (\d+) \|", table.split("\n\n", 1)[0], re.M)
        assert codes and sorted(listed, key=int) == sorted(codes, key=int), (doc.name, codes, said)
