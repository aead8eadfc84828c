"""The control path at its edges: a conversion that raises fails
its document alone and loses nothing in flight; documents convert one ahead in a worker
thread, beside the engine's steps; a converted kind is sized by its text, not its bytes;
a file replaced by a link out of INPUT after discovery is refused, not read; the report
never keeps the model alive; one kernel default per caller; library errors name
settings (``field``), never CLI flags.
"""

import gc
import json
import os
import threading
import weakref

import pytest
from support.jobs import _short_context, make_docs, small_moe  # noqa: F401 - fixtures
from typer.testing import CliRunner

from mlx_tier.cli.main import app
from mlx_tier.errors import BudgetError, ConfigError, InputError
from mlx_tier.job import doc_text as converters
from mlx_tier.job import documents
from mlx_tier.job.config import read_prompt
from mlx_tier.job.doc_text import Converted
from mlx_tier.job.run import JobConfig, Reporter, run_job
from mlx_tier.job.scheduler import GenerationConfig
from mlx_tier.outdir.journal import Journal

runner = CliRunner()


def _failing_for(monkeypatch, name: str, error: BaseException) -> list[tuple[str, str]]:
    """Make converting the file ``name`` raise ``error``; returns ``(file, thread)`` per conversion."""
    seen, real = [], documents.convert_file

    def convert(path, inside=None, **limits):
        seen.append((path.name, threading.current_thread().name))
        if path.name == name:
            raise error
        return real(path, inside, **limits)

    monkeypatch.setattr(documents, "convert_file", convert)
    return seen


def test_a_conversion_that_raises_fails_that_document_alone(tmp_path, small_moe, monkeypatch):  # noqa: F811
    docs, out = tmp_path / "docs", tmp_path / "out"
    make_docs(docs, 4)
    _failing_for(monkeypatch, "doc01.txt", RuntimeError("broken PDF library"))
    config = JobConfig(input=docs, out_dir=out, model=small_moe, generation=GenerationConfig(max_tokens=4, batch_size=2))
    report = run_job(config)
    states = {r.id: r.status for r in report.results}
    assert states == {"doc00": "done", "doc01": "failed", "doc02": "done", "doc03": "done"}  # doc00 was in flight
    failed = Journal(out).records()["doc01"]
    assert failed["status"] == "failed" and "RuntimeError" in failed["error"] and "broken PDF" in failed["error"]
    reported = {d["id"]: d for d in json.loads((out / "report.json").read_text())["documents"]}
    assert reported["doc01"]["status"] == "failed" and "broken PDF" in reported["doc01"]["error"]


def test_a_conversion_error_fails_the_document_but_memory_errors_stop_the_job(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("river flood.")
    _failing_for(monkeypatch, "a.txt", KeyError("codec"))
    (doc,) = documents.discover(tmp_path)
    assert doc.text is None and doc.error.startswith("cannot convert (KeyError)")
    with pytest.raises(InputError, match="a.txt: cannot convert .KeyError."):
        documents.discover(tmp_path / "a.txt")  # the input itself: one clear error, no traceback
    _failing_for(monkeypatch, "a.txt", MemoryError())
    (doc,) = documents.discover(tmp_path)
    with pytest.raises(MemoryError):
        doc.text  # noqa: B018 - converts


class _Steps(Reporter):
    """Counts engine steps; sets ``stepped`` once a step ran after ``armed`` was set."""

    def __init__(self):
        self.armed, self.stepped = threading.Event(), threading.Event()

    def working(self, activity):
        if self.armed.is_set():
            self.stepped.set()


def test_the_next_document_converts_in_a_worker_while_the_engine_steps(tmp_path, small_moe, monkeypatch):  # noqa: F811
    docs, out = tmp_path / "docs", tmp_path / "out"
    make_docs(docs, 3)
    reporter, overlapped, real = _Steps(), [], documents.convert_file
    threads = []

    def convert(path, inside=None, **limits):  # doc01 converts slowly: until the engine steps beside it
        threads.append(threading.current_thread().name)
        if path.name == "doc01.txt":
            reporter.armed.set()
            overlapped.append(reporter.stepped.wait(timeout=20))
        return real(path, inside, **limits)

    monkeypatch.setattr(documents, "convert_file", convert)
    config = JobConfig(input=docs, out_dir=out, model=small_moe, generation=GenerationConfig(max_tokens=8, batch_size=1))
    assert run_job(config, reporter).count("done") == 3
    assert overlapped == [True]  # engine steps ran while doc01 was still converting
    assert all(t.startswith("mlx-tier-convert") for t in threads) and len(threads) == 3


def test_converted_kinds_are_sized_by_their_text_and_text_files_by_their_bytes(tmp_path, monkeypatch):
    (tmp_path / "a.pdf").write_bytes(b"%PDF-1.4 " + b"\0" * 5000)  # bytes that are mostly not text
    (tmp_path / "b.docx").write_bytes(b"PK" + b"\0" * 3000)
    (tmp_path / "c.md").write_text("é" * 100)  # 200 bytes of UTF-8: erring long
    texts = {"a.pdf": "x" * 40, "b.docx": "y" * 70}
    monkeypatch.setattr(documents, "convert_file", lambda path, inside=None, **_: Converted(texts[path.name], None, "fake"))
    a, b, c = documents.discover(tmp_path)
    assert [documents.size_hint(d) for d in (a, b, c)] == [40, 70, 200]
    fresh = documents.discover(tmp_path)
    assert documents.size_hint(fresh[0], convert=False) == 0 and "_converted" not in fresh[0].__dict__
    assert documents.size_hint(documents.Document("j", "x:1", "z" * 9)) == 9


def _plant_link_after_discovery(monkeypatch, name: str, target):
    """Replace INPUT's file ``name`` by a link to ``target`` just after the job found its documents."""
    import mlx_tier.job.run as jobs

    real = jobs.find_documents

    def find(config, *args):
        docs = real(config, *args)
        victim = config.input / name
        victim.unlink()
        victim.symlink_to(target)
        return docs

    monkeypatch.setattr(jobs, "find_documents", find)


def test_a_file_replaced_by_a_link_out_of_input_after_discovery_is_not_read(tmp_path, small_moe, monkeypatch):  # noqa: F811
    docs, out, secret = tmp_path / "docs", tmp_path / "out", tmp_path / "secret.txt"
    make_docs(docs, 3)
    secret.write_text("the secret words: zebra quokka.")
    _plant_link_after_discovery(monkeypatch, "doc01.txt", secret)
    read = []
    real_open = converters.open_inside
    monkeypatch.setattr(converters, "open_inside", lambda root, p: read.append(p) or real_open(root, p))
    report = run_job(JobConfig(input=docs, out_dir=out, model=small_moe, generation=GenerationConfig(max_tokens=4)))
    doc01 = next(r for r in report.results if r.id == "doc01")
    assert doc01.status == "failed" and "link leading outside the input folder" in doc01.error
    assert report.count("done") == 2 and secret.resolve() not in read
    # each of the two documents opened three times through open_inside: looked at (blank?, before the model
    # loads: documents.fails_unread), hashed (what its summary is made from), converted
    assert sorted(p.name for p in read) == ["doc00.txt"] * 3 + ["doc02.txt"] * 3


def test_a_link_planted_in_input_is_refused_for_converted_kinds_and_kept_inside(tmp_path):
    docs, secret = tmp_path / "docs", tmp_path / "secret.html"
    docs.mkdir()
    secret.write_text("<p>zebra</p>")
    (docs / "a.html").write_text("<p>river</p>")
    (docs / "b.txt").write_text("flood spring.")
    (docs / "c.txt").write_text("inside.")
    found = {d.name: d for d in documents.discover(docs)}
    (docs / "a.html").unlink()
    (docs / "a.html").symlink_to(secret)
    (docs / "b.txt").unlink()
    (docs / "b.txt").symlink_to(docs / "c.txt")  # a link that stays inside INPUT is a document
    assert "outside the input folder" in found["a.html"].error and found["a.html"].text is None
    assert found["b.txt"].text == "inside."
    followed = {d.name: d for d in documents.discover(docs, follow_links=True)}
    assert "zebra" in followed["a.html"].text  # follow_links: the user asked for links to be read


def test_the_report_does_not_keep_the_model_alive(tmp_path, small_moe, monkeypatch):  # noqa: F811
    from mlx_tier.engine import load as tiered

    refs, real_load = [], tiered.load

    def load(path, cache_gb=None, *, config=None):
        model, tokenizer = real_load(path, cache_gb, config=config)
        refs.append(weakref.ref(model))
        return model, tokenizer

    monkeypatch.setattr(tiered, "load", load)
    docs = tmp_path / "docs"
    make_docs(docs, 2)
    report = run_job(JobConfig(input=docs, out_dir=tmp_path / "out", model=small_moe,
                               generation=GenerationConfig(max_tokens=4)))
    gc.collect()
    assert report.count("done") == 2 and len(refs) == 1
    assert refs[0]() is None  # the caller holds the report, not the model
    assert report.run.loaded_model and report.runs[-1]["loaded_model"]


def test_each_caller_has_one_kernel_default(tiny_moe):
    from mlx_tier.defaults import JOB_KERNEL
    from mlx_tier.engine.load import TierConfig, load

    assert TierConfig().kernel is None  # "the caller's default"
    assert JobConfig(input=".", out_dir="o").tier.kernel == JOB_KERNEL == "auto"
    assert JobConfig(input=".", out_dir="o", tier=TierConfig(cache_gb=0.5)).tier.kernel == JOB_KERNEL
    assert JobConfig(input=".", out_dir="o", tier=TierConfig(kernel="mlx")).tier.kernel == "mlx"  # asked for
    model, _ = load(tiny_moe, config=TierConfig(cache_gb=0.5))
    assert model.expert_cache.kernel == "mlx"  # the library's default: tokens exactly as mlx-lm's


def test_each_caller_has_one_dtype_default(tiny_moe_bf16):
    """The library casts nothing (tokens as mlx_lm.load's); the job computes in
    float32 on MLX's CPU backend (faster there) and records it in report.json."""
    import mlx.core as mx

    from mlx_tier.engine.dtypes import job_compute_dtype
    from mlx_tier.engine.load import TierConfig, load
    from mlx_tier.job.model_setup import Loaded, load_model, setup_record

    cpu = mx.default_device() == mx.cpu
    assert TierConfig().dtype is None and job_compute_dtype() == (mx.float32 if cpu else None)
    assert JobConfig(input=".", out_dir="o").tier.dtype is None  # decided by each machine that loads it
    model, _ = load(tiny_moe_bf16, config=TierConfig(kernel="mlx"))
    assert model.layers[0].self_attn.q_proj.scales.dtype == mx.bfloat16  # as stored
    assert setup_record(Loaded(model, None, tiny_moe_bf16, 512), JobConfig(input=".", out_dir="o"))["dtype"] == "as stored"
    config = JobConfig(input=".", out_dir="o", model=tiny_moe_bf16, tier=TierConfig(kernel="mlx"))
    loaded = load_model(config, Reporter())
    assert loaded.model.layers[0].self_attn.q_proj.scales.dtype == (mx.float32 if cpu else mx.bfloat16)
    assert setup_record(loaded, config)["dtype"] == ("float32" if cpu else "as stored")


def test_library_errors_carry_their_setting_and_no_flag(tiny_moe):
    from mlx_tier.cli.render import as_flags
    from mlx_tier.engine.load import TierConfig, load, plan_slots
    from mlx_tier.job.sensors import Reading
    from mlx_tier.job.throttle import Controller, ThrottleConfig

    with pytest.raises(BudgetError) as budget:
        plan_slots(10, num_layers=2, slot_nbytes=100, num_experts=8)
    with pytest.raises(ConfigError) as future:
        load(tiny_moe, config=TierConfig(cache_gb=0.5, policy="belady"))
    with pytest.raises(InputError) as empty:
        read_prompt("  ")
    for e, field in ((budget, "cache_gb"), (future, "policy"), (empty, "instruction")):
        assert e.value.field == field and "--" not in str(e.value)
    assert as_flags(str(empty.value)).startswith("--prompt is empty")
    controller = Controller(ThrottleConfig(max_temp=50, pause_on_battery=True, min_battery=30))
    reason = controller.proposal(Reading(max_temp_c=90.0, on_battery=True, battery_percent=10.0)).reason
    assert "--" not in reason and "`max_temp` 50" in reason and "`min_battery` 30%" in reason
    assert "--max-temp 50" in as_flags(reason) and "--pause-on-battery" in as_flags(reason)


def test_library_texts_name_settings_not_flags():
    """Every string literal (docstrings aside) of the modules the review named: no ``--flag``."""
    import ast
    import inspect
    import re

    from mlx_tier.engine import load as tiered
    from mlx_tier.engine import memory
    from mlx_tier.job import run as jobs
    from mlx_tier.job import scheduler, throttle

    for module in (scheduler, memory, jobs, throttle, tiered):
        tree = ast.parse(inspect.getsource(module))
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and n.body
                      and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        texts = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                 and id(n) not in docstrings]
        assert [t for t in texts if re.search(r"--[a-z]", t)] == [], module.__name__


@pytest.mark.parametrize("prompt", ["", "   "])
def test_an_empty_prompt_is_one_clear_error(tmp_path, prompt):
    docs = tmp_path / "docs"
    make_docs(docs, 1)
    r = runner.invoke(app, ["run", str(docs), "--out", str(tmp_path / "out"), "--prompt", prompt])
    assert r.exit_code == 2 and "--prompt is empty" in r.output and not (tmp_path / "out").exists()
    assert os.path.exists(docs)
