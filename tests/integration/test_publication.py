"""Runs are published whole (issue 31, item 2): a report or a training table set is written entirely or
the previous one stays, on a disk that fills up while they are written (a real tmpfs of a few MiB)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from pathlib import Path

import pytest

from actlake.errors import StorageError
from actlake.storage.sql import query
from tests.conftest import job_config

pytestmark = pytest.mark.integration


@contextlib.contextmanager
def small_disk(folder: Path, size: str):
    """A tmpfs of ``size`` at ``folder`` (root and a kernel that allows it, as on this project's machines)."""
    folder.mkdir(parents=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def _fill(folder: Path, leave: int) -> None:
    """Fill the disk of ``folder`` but ``leave`` bytes."""
    free = shutil.disk_usage(folder).free
    (folder / "filler").write_bytes(bytes(max(0, free - leave)))


def test_a_report_on_a_full_disk_keeps_the_previous_one(tiny_models, sample_corpus, tmp_path, ray_local):
    from actlake.jobs.extract.report import build_report
    from actlake.jobs.extract.run import run_job

    res = run_job(job_config(tiny_models["bert"], sample_corpus, tmp_path / "runs",
                             **{"corpus.max_docs": 8, "output.report": True}))
    before = {p.name: p.read_bytes() for p in (Path(res.run_dir) / "report").iterdir()}
    assert "report.html" in before
    with small_disk(tmp_path / "disk", "64m") as disk:
        run = disk / "run"
        shutil.copytree(res.run_dir, run)
        _fill(disk, 50_000)  # room for a few charts, not for the page (its inlined Vega is about 1 MB)
        with pytest.raises(StorageError, match=rf"^{run}/report: cannot write the report \(No space left on device\); "
                                               "the previous report is kept"):
            build_report(run)
        assert {p.name: p.read_bytes() for p in (run / "report").iterdir()} == before
        assert sorted(p.name for p in run.iterdir() if p.name.startswith(".report")) == []


def test_a_predictor_rerun_without_probes_unpublishes_probe_scores(tmp_path):
    """The publication record is the run's table set: a table a rerun turns off is gone from SQL, and files
    written but not recorded (a job that died before publishing) are never served."""
    import json

    import pyarrow as pa

    from actlake.storage.layout import write_json_atomic
    from actlake.storage.parquet_io import write_parquet
    from actlake.storage.publish import pending_file, publish_pending

    run = tmp_path / "run"
    write_json_atomic(run / "run.json", {"format": 2, "run_id": "run", "kind": "predictor"})

    def attempt(layers, probes: bool):
        for layer in layers:
            write_parquet(pa.table({"mse": [float(layer)]}), pending_file(run, "predictor_summary", f"layer={layer}"))
            if probes:
                write_parquet(pa.table({"task": ["source"], "macro_f1": [0.5]}), pending_file(run, "probe_scores", f"layer={layer}"))
        publish_pending(run, drop=() if probes else ("probe_scores",))

    attempt([1, 2], probes=True)
    assert query(run, "SELECT count(*) AS n FROM probe_scores").to_pylist() == [{"n": 2}]
    attempt([1, 2], probes=False)
    tables = {r["name"] for r in query(run, "SELECT table_name AS name FROM information_schema.tables").to_pylist()}
    assert "probe_scores" not in tables and "predictor_summary" in tables
    assert not list((run / "tables" / "probe_scores").rglob("*.parquet"))  # unnamed files removed
    # an attempt that wrote its files but died before publishing: nothing of it is served
    write_parquet(pa.table({"mse": [9.0]}), pending_file(run, "predictor_summary", "layer=3"))
    stray = run / "tables" / "predictor_summary" / "layer=3" / "part-0.parquet"
    write_parquet(pa.table({"mse": [9.0]}), stray)
    assert query(run, "SELECT sum(mse) AS s FROM predictor_summary").to_pylist() == [{"s": 3.0}]
    record = json.loads((run / "_complete" / "published.json").read_text())
    assert sorted(record["files"]) == ["predictor_summary"] and len(record["files"]["predictor_summary"]) == 2


def test_a_synthetic_analysis_on_a_full_disk_publishes_none_of_its_tables(tmp_path, ray_local, capsys):
    """It published 4 of its 6 tables before."""
    import yaml

    from actlake.jobs.cli import main
    from actlake.storage.sql import open_run
    from tests.integration.test_synthetic import _data

    data = _data(tmp_path / "runs")
    data["training"].update(steps=20, batch_size=32, n_checkpoints=3, checkpoint_every=10, eval_every=10,
                            eval_sequences=64)
    data["analysis"].update(sequences=50, vary_one_sequences=20, random_models=1)
    data["output"].update(report=False)
    cfg = tmp_path / "syn.yaml"
    cfg.write_text(yaml.safe_dump(data))
    assert main(["train-synthetic", str(cfg)]) == 0

    def tables(run) -> dict:
        con = open_run(run)
        names = [r[0] for r in con.execute("SELECT table_name FROM information_schema.tables ORDER BY 1").fetchall()]
        return {t: con.execute(f"SELECT * FROM {t} ORDER BY ALL").fetchall() for t in names}

    with small_disk(tmp_path / "disk", "64m") as disk:
        run = disk / "syn"
        shutil.copytree(tmp_path / "runs" / "syn", run)
        before = tables(run)
        assert {"factored_dimension", "activations", "training_curves"} <= set(before)
        data["output"]["dir"] = str(disk)
        data["analysis"]["sequences"] = 60  # other rows than those published: a partial publication would show
        cfg.write_text(yaml.safe_dump(data))
        _fill(disk, 20_000)
        capsys.readouterr()
        assert main(["train-synthetic", str(cfg), "--analysis-only"]) == 2
        assert "No space left on device" in capsys.readouterr().err
        (disk / "filler").unlink()
        assert tables(run) == before
