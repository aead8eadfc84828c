"""A run says which files of its INPUT folder it left out, in one line of at most 80
columns as it starts (the no-documents error's words: ``skipped N files: reason count,
...``), and report.json counts them (``skipped_files``); a folder it reads whole says
nothing.
"""

import json
from collections import Counter

import pytest
from support.jobs import _short_context, small_moe  # noqa: F401 - fixtures
from support.output import eighty_columns  # noqa: F401 - a fixture
from typer.testing import CliRunner

from mlx_tier.cli.main import app
from mlx_tier.errors import InputError
from mlx_tier.job.documents import discover_list, skip_note

runner = CliRunner()
pytestmark = pytest.mark.usefixtures("eighty_columns")


def run(folder, out, model):
    r = runner.invoke(app, ["run", str(folder), "--out", str(out), "--model", str(model), "--max-tokens", "4"])
    skipped = [line for line in r.output.splitlines() if line.startswith("skipped ")]
    report = json.loads((out / "report.json").read_text())
    return r, skipped, report


def test_files_left_out_of_a_folder_are_said_and_counted(tmp_path, small_moe):  # noqa: F811
    """A user trial: seven files, one .txt; only a.txt was summarised and nothing said why
    the other six were left out."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for name in ("notes", "README", "data.csv", "e.json", "g.log", "x.TXT.BAK", "a.txt"):
        (docs / name).write_text(f"Content of {name} about the river and the farmer.")
    r, skipped, report = run(docs, tmp_path / "out", small_moe)
    assert r.exit_code == 0, r.output
    assert skipped == ["skipped 6 files: no suffix 2, .csv 1, .json 1, .log 1, other 1"], r.output
    assert report["skipped_files"] == {"no suffix": 2, ".csv": 1, ".json": 1, ".log": 1,
                                       "temporary or backup file": 1}
    assert [d["id"] for d in report["documents"]] == ["a"]


def test_a_long_list_is_cut_to_one_line_and_folders_are_counted_apart(tmp_path, small_moe):  # noqa: F811
    """Many kinds with long suffixes: the reasons that fit 80 columns, the rest as ``other``;
    the job's own output folder inside INPUT and a hidden folder are counted as folders. A
    rerun says it again; a folder with nothing to leave out says nothing."""
    docs = tmp_path / "docs"
    (docs / ".git").mkdir(parents=True)
    (docs / "doc.md").write_text("The library opens at nine; bees carry pollen.")
    for i in range(9):
        (docs / f"export{i}.spreadsheet-backup-{i:02d}").write_text("x")
    (docs / "more.spreadsheet-backup-00").write_text("x")
    out = docs / "summaries"
    out.mkdir()
    for _ in range(2):  # the first run and a rerun with nothing to do
        r, skipped, report = run(docs, out, small_moe)
        assert r.exit_code == 0, r.output
        assert skipped == ["skipped 10 files, 2 folders: .spreadsheet-backup-00 2, other 10"], r.output
        assert report["skipped_files"][".spreadsheet-backup-00"] == 2
        assert report["skipped_files"]["hidden folder"] == report["skipped_files"]["output folder"] == 1
        assert sum(report["skipped_files"].values()) == 12

    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "a.txt").write_text("The farmer planted seed in spring.")
    r, skipped, report = run(plain, tmp_path / "out2", small_moe)
    assert r.exit_code == 0 and skipped == [] and report["skipped_files"] == {}, r.output


def test_skip_note_fits_its_width_and_a_stdin_list_counts_too(tmp_path):
    assert skip_note(Counter({"output folder": 1})) == "skipped 1 folder: output folder 1"
    assert skip_note(Counter({"." + "x" * 90: 1, "hidden file": 3})) == "skipped 4 files: hidden file 3, other 1"
    assert skip_note(Counter({"." + "x" * 90: 1})) == "skipped 1 file"
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "journal.jsonl").write_text('{"event": "start", "run": "r1"}\n')  # a job's folder
    paths = [tmp_path / "a.txt", tmp_path / "a.txt.bak", tmp_path / "out" / "a.md", tmp_path / "._a.txt"]
    for p in paths:
        p.write_text("some text")
    skipped = Counter()
    docs = discover_list([str(p) for p in paths], exclude=tmp_path / "out", skipped=skipped)
    assert [d.name for d in docs] == [str(paths[0])]
    assert skip_note(skipped) == ("skipped 3 files: in the output folder 1, macOS metadata (AppleDouble) 1, "
                                  "other 1")
    # a trial: a listed file inside an output folder of the user's own (no job's yet) was skipped,
    # and the run wrote its summaries and reports beside it: refused, as `run FILE` is
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "y.txt").write_text("my notes")
    with pytest.raises(InputError, match=r"stdin:2: .*y.txt is inside the output folder .*no mlx-tier job's"):
        discover_list([str(paths[0]), str(tmp_path / "mine" / "y.txt")], exclude=tmp_path / "mine")
