"""Checks on a job's output folder before anything is written there.

Invariant 3: nothing is written outside OUT_DIR. A link planted in OUT_DIR
under a name the job writes (``journal.jsonl`` -> ``~/.bashrc``) would make an
append land elsewhere, so such a folder is refused whole, with one line.
OUT_DIR equal to INPUT, or holding it, would mix summaries with documents.
"""

from __future__ import annotations

from pathlib import Path

from .documents import InputError
from .journal import JOURNAL, SUMMARIES
from .status import INPUT_LIST, LOCK, LOG_FILE, PID_FILE

# Files a run writes in OUT_DIR besides the <id>.md summaries.
JOB_FILES = (JOURNAL, SUMMARIES, LOCK, "report.json", PID_FILE, LOG_FILE, INPUT_LIST)


def check_out_dir(out_dir: Path, input: Path | None = None) -> None:
    """Refuse an output folder the job must not write in.

    Args:
        out_dir: the job's output folder (it need not exist yet).
        input: the job's INPUT when it is a folder or file (``None`` for a path list).

    Raises:
        InputError: ``out_dir`` is the input folder or contains it, or a job
            file or a ``.md`` output in it is a symbolic link.
    """
    out_dir = Path(out_dir)
    if input is not None and Path(input).is_dir():
        out, inp = out_dir.resolve(), Path(input).resolve()
        if out == inp:
            raise InputError(f"{out_dir}: the output folder is the input folder; summaries would mix "
                             "with the documents (choose another folder)")
        if inp.is_relative_to(out):
            raise InputError(f"{out_dir}: the output folder contains the input folder {input}; "
                             "choose a folder outside it")
    if not out_dir.is_dir():
        return
    for entry in sorted(out_dir.iterdir()):
        if entry.is_symlink() and (entry.name in JOB_FILES or entry.suffix == ".md"):
            raise InputError(f"{entry}: is a symbolic link; refusing to write through it "
                             "(remove it, or choose another output folder)")
