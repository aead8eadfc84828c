"""The job's configuration, built once at the edge (the CLI) and passed down whole.

:class:`JobConfig` holds what a run summarises, where, with which model and
settings; :func:`read_prompt` reads the instruction a user gives (text or
``@FILE``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from mlx_tier.defaults import JOB_KERNEL
from mlx_tier.engine.load import TierConfig
from mlx_tier.errors import InputError
from mlx_tier.job.convert_limits import ConversionLimits
from mlx_tier.job.process import DEFAULT_NICE
from mlx_tier.job.scheduler import GenerationConfig
from mlx_tier.job.throttle import ThrottleConfig


@dataclass(frozen=True)
class JobConfig:
    """What to summarise, where, and with which model. Built once (by the CLI)
    and passed down whole: its parts reach the layers that use them unchanged.

    Attributes:
        input: what to summarise: a folder (recursive; every file with a suffix in
            :data:`mlx_tier.job.documents.SUFFIXES`: text in any common encoding,
            PDF, Word, PowerPoint, Excel, HTML, EPUB... converted by
            :mod:`mlx_tier.job.doc_text`; hidden, lock and backup files skipped),
            a single document file, or a ``.jsonl`` file (one ``{"custom_id"
            or "id", "text"}`` object per line, or one OpenAI batch request per
            line: run as written, answers in ``out_dir/output.jsonl``). With
            ``input_paths`` (``mlx-tier run -``: paths read from stdin) it only
            names the input in the journal (:func:`mlx_tier.job.documents.discover`).
        out_dir: summaries go to ``out_dir/<id>.md``; journal and report beside them.
        model: mlx-lm MoE checkpoint directory or hub repo id; ``None``: the built-in demo model.
        tier: how the model is tiered (cache budget, policy, prefetch, kernel...):
            given to :func:`mlx_tier.engine.load.load` as it is. Its ``kernel``
            left ``None`` (TierConfig's default: "the caller's default") is
            the job's default, :data:`~mlx_tier.defaults.JOB_KERNEL`, set here
            once (``load()`` alone would use ``"mlx"``). Its ``dtype`` left
            ``None`` is decided where the model is loaded, by that machine's
            backend (a rank's, with several): float32 on MLX's CPU backend, for
            speed (:func:`mlx_tier.engine.dtypes.job_compute_dtype`; ``load()``
            alone would cast nothing, as ``mlx_lm.load``).
        generation: how summaries are generated (prompt, max tokens, batch size,
            context...): given to the :class:`~mlx_tier.job.scheduler.Scheduler` as it is.
        throttle: the thermal-aware throttle's settings (:mod:`mlx_tier.job.throttle`).
        trace: write this run's routing trace (:mod:`mlx_tier.routing.trace`) here.
        input_paths: a list of file paths to summarise instead of ``input``
            (``mlx-tier run -`` reads it from stdin; kept in ``OUT_DIR/inputs.txt``).
        output_format: ``md`` (``<id>.md`` files) or ``jsonl`` (also
            ``OUT_DIR/summaries.jsonl``, one line per finished document).
        retry_failed: run only the documents that failed in an earlier run
            (a plain rerun runs pending documents and keeps failed ones failed).
        redo_changed: also redo the summaries an earlier run wrote with another
            model or prompt (kept by default, and said so). A summary whose
            document changed since is redone in any case
            (:mod:`mlx_tier.job.provenance`).
        command: the command line that resumes this job, recorded in
            the journal's ``start`` record for ``mlx-tier status``.
        nice: CPU priority decrease (``os.nice`` increment; 0 = unchanged).
        background_qos: macOS background QoS (slows Metal ~8x; off by default).
        save_profile: after the run, add its expert use counts to the
            checkpoint's saved profile (next to it, or in the user cache).
        follow_links: read links in an INPUT folder that lead outside it.
        conversion: how large and how long converting one document (PDF,
            Word...) may get; over it, that document fails alone
            (:class:`~mlx_tier.job.convert_limits.ConversionLimits`).
        memory_gb: the memory the run may hold in all (GiB), split into the
            expert cache, the KV cache, the step's workspace and the rest
            (:func:`mlx_tier.engine.footprint.split`); ``None``: what this process
            may use (its cgroup's limit or the host's available memory,
            :mod:`mlx_tier.engine.limits`). A split that cannot fit is refused
            before the model is loaded.
    """

    input: Path
    out_dir: Path
    model: Path | str | None = None
    tier: TierConfig = field(default_factory=TierConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    throttle: ThrottleConfig = field(default_factory=ThrottleConfig)
    trace: Path | None = None
    input_paths: tuple[str, ...] | None = None
    output_format: str = "md"
    retry_failed: bool = False
    redo_changed: bool = False
    command: str | None = None
    nice: int = DEFAULT_NICE
    background_qos: bool = False
    save_profile: bool = False
    follow_links: bool = False
    conversion: ConversionLimits = field(default_factory=ConversionLimits)
    memory_gb: float | None = None

    def __post_init__(self):
        if self.tier.kernel is None:  # the one place the job's kernel default is applied
            object.__setattr__(self, "tier", replace(self.tier, kernel=JOB_KERNEL))



def read_prompt(value: str) -> str:
    """The instruction from its given value: literal text, or ``@FILE`` to read it from a file.

    Raises:
        InputError: the text is blank, or the file is missing, unreadable or
            empty (``field``: ``instruction``).
    """
    if not value.startswith("@"):
        if not value.strip():
            raise InputError("`instruction` is empty: give the instruction's text, or @FILE", "instruction")
        return value
    path = Path(value[1:])
    try:
        text = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: cannot read prompt file ({e})", "instruction") from None
    if not text:
        raise InputError(f"{path}: prompt file is empty", "instruction")
    return text
