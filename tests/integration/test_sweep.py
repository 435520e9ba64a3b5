"""A checkpoint sweep (``model.checkpoints``): tiny models saved as a series (two different, one an exact copy).
The copy is flagged; each checkpoint's rows equal a single-model run on it; a rerun resumes every checkpoint."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from actlake.jobs.cli import main
from actlake.jobs.extract.run import run_job
from actlake.storage.sql import open_run
from tests.conftest import job_config
from tests.documented import command

STATISTICS = ("dim_moments", "attention_mass", "contributions", "attention_geometry", "attention_by_distance")


@pytest.fixture(scope="module")
def series(tiny_models, tmp_path_factory) -> dict[str, Path]:
    """step 0: the tiny GPT-2; step 10: its weights moved; step 20: a byte-identical copy of step 0."""
    import torch
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("series")
    first, moved, copy = root / "step0", root / "step10", root / "step20"
    shutil.copytree(tiny_models["gpt2"], first)
    shutil.copytree(tiny_models["gpt2"], moved)
    shutil.copytree(tiny_models["gpt2"], copy)
    model = AutoModelForCausalLM.from_pretrained(moved)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(moved)
    return {"step-0": first, "step-10": moved, "step-20": copy}


def test_a_sweep_flags_the_copy_and_each_checkpoint_equals_a_run_on_it(series, sample_corpus, tmp_path, ray_local, capsys):
    points = [{"path": str(p), "step": int(label.split("-")[1])} for label, p in series.items()]
    over = {"corpus.max_docs": 8, "sharding.docs_per_shard": 4}
    cfg = job_config(series["step-0"], sample_corpus, tmp_path / "runs", **over, **{"model.checkpoints": points,
                                                                                    "output.report": True})
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    assert main(["run", str(path), "--run-id", "sweep"]) == 0
    out = capsys.readouterr().out
    assert "checkpoints: step-0, step-10, step-20 (IDENTICAL WEIGHTS, step-20: same weights as step-0)" in out
    run = tmp_path / "runs" / "sweep"
    con = open_run(run)
    rows = con.execute("SELECT checkpoint, ordinal, step, sha256, same_as FROM checkpoints ORDER BY ordinal").fetchall()
    assert [(r[0], r[1], r[2], r[4]) for r in rows] == [("step-0", 0, 0, None), ("step-10", 1, 10, None),
                                                         ("step-20", 2, 20, "step-0")]
    assert rows[0][3] == rows[2][3] != rows[1][3]
    for label in ("step-10", "step-20"):  # each checkpoint's rows are a single-model run's
        alone = run_job(job_config(series[label], sample_corpus, tmp_path / f"alone-{label}", **over))
        _assert_checkpoint_is_run(con, label, alone.run_dir)
    copies = con.execute("SELECT count(*) FROM (SELECT * EXCLUDE (checkpoint) FROM attention_mass WHERE checkpoint = "
                         "'step-0' EXCEPT SELECT * EXCLUDE (checkpoint) FROM attention_mass WHERE checkpoint = 'step-20')"
                         ).fetchall()[0][0]
    assert copies == 0  # the copy's statistics are its original's
    con.close()
    page = (run / "report" / "report.html").read_text()
    assert "same weights as step-0" in page and "Across checkpoints: attention mass on the leading" in page
    assert (run / "report" / "sweep_first_token_mass.png").read_bytes()[:4] == b"\x89PNG"
    assert re.search(r'"type":\s*"symlog"', page) and re.search(r'"scheme":\s*"category10"', page)  # issue 53
    assert main(["sql", str(run), "SELECT checkpoint, count(*) AS n FROM documents GROUP BY 1 ORDER BY 1"]) == 0
    assert capsys.readouterr().out.count("│ step-") == 3
    shown = subprocess.run(["bash", "-c", command("sweep-sql").replace("runs/sweep", str(run))], capture_output=True,
                           text=True, timeout=120, env=dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}"))
    assert shown.returncode == 0 and shown.stdout.count("│") > 20 and "mass_on_first" in shown.stdout, shown.stderr
    steps = {int(m) for m in re.findall(r"^│\s*(\d+)\s*│", shown.stdout, re.M)}
    assert steps == {0, 10}, shown.stdout  # the copy (step 20, same_as step-0) is left out, as the query says
    assert main(["run", str(path), "--run-id", "sweep", "--no-report"]) == 0  # a rerun: every checkpoint resumes
    assert "(0 of 6 shards ran)" in capsys.readouterr().out


def _assert_checkpoint_is_run(con, label: str, run_dir) -> None:
    """The sweep's rows of checkpoint ``label`` (``con``: the sweep opened) equal the run's in ``run_dir``."""
    own = open_run(run_dir)
    for table in STATISTICS + ("tokens", "outliers"):
        mine = con.execute(f"SELECT * EXCLUDE (checkpoint) FROM {table} WHERE checkpoint = '{label}' ORDER BY ALL").df()
        theirs = own.execute(f"SELECT * FROM {table} ORDER BY ALL").df()
        assert list(mine.columns) == list(theirs.columns) and len(mine) == len(theirs) > 0, table
        for col in mine.columns:
            if mine[col].dtype.kind == "f":
                np.testing.assert_allclose(mine[col], theirs[col], rtol=1e-12, atol=1e-12, err_msg=f"{table}.{col}")
            else:
                assert mine[col].tolist() == theirs[col].tolist(), f"{table}.{col}"
    own.close()


def test_a_sweep_keeps_its_workers_and_a_restarted_one_serves_the_checkpoint_it_is_called_for(series, sample_corpus,
                                                                                              tmp_path, ray_local):
    """The first checkpoint's worker process serves the second; killed there after a shard, Ray restarts it with
    the arguments it was made with (the first checkpoint's), and the shards it runs then are still the second's:
    that checkpoint's rows equal a run on it alone."""
    import os
    import signal

    over = {"corpus.max_docs": 12, "sharding.docs_per_shard": 4, "sharding.commit_seconds": 0.001,
            "resources.max_retries": 2}
    points = [{"path": str(series[label]), "step": int(label.split("-")[1])} for label in ("step-0", "step-10")]
    cfg = job_config(series["step-0"], sample_corpus, tmp_path / "runs", **over, **{"model.checkpoints": points})
    pids = []

    def kill_after_the_second_checkpoint_s_first_shard(summary):
        pids.append(summary["pid"])
        if len(pids) == 4:  # 3 shards per checkpoint
            os.kill(summary["pid"], signal.SIGKILL)

    run_job(cfg, on_shard=kill_after_the_second_checkpoint_s_first_shard)
    assert len(set(pids[:4])) == 1 and pids[-1] != pids[0], pids  # one process for both; then its restart
    alone = run_job(job_config(series["step-10"], sample_corpus, tmp_path / "alone", **over))
    _assert_checkpoint_is_run(open_run(cfg.run_dir), "step-10", alone.run_dir)


def test_a_checkpoint_whose_model_cannot_load_fails_with_the_load_error_on_a_kept_worker(series, sample_corpus, tmp_path,
                                                                                         ray_local):
    """The first checkpoint's worker is kept for the second, whose weights are damaged: the job ends with the
    loading error itself, on one line (it would repeat on every shard and every rerun), not with a worker that
    half took on the new job."""
    from actlake.errors import ModelLoadError

    broken = Path(shutil.copytree(series["step-10"], tmp_path / "broken"))
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    over = {"corpus.max_docs": 8, "sharding.docs_per_shard": 4}
    points = [{"path": str(series["step-0"]), "step": 0}, {"path": str(broken), "step": 10}]
    cfg = job_config(series["step-0"], sample_corpus, tmp_path / "runs", **over, **{"model.checkpoints": points})
    with pytest.raises(ModelLoadError) as e:
        run_job(cfg)
    msg = str(e.value)
    assert msg.startswith(f"model {broken}: cannot load (SafetensorError") and "\n" not in msg, msg
    assert "NoneType" not in msg and "rerun" not in msg, msg
