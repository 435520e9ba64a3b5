"""train-synthetic end to end on real Ray Train: a short run on one Mess3 factor learns (loss towards the
Bayes-optimal loss, belief R² above the untrained model's), and the analysis tables are consistent."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import pytest

from actlake.config import parse_config
from actlake.jobs.train.synthetic.config import SyntheticConfig
from actlake.storage.sql import open_run
from tests.integration.browser import CHROMIUM, open_report

pytestmark = [pytest.mark.integration, pytest.mark.slow]


RAY_LOG_LINE = re.compile(r"^(\x1b\[[0-9;]*m)?\((\w+ )?(pid=|raylet)")
"""Lines Ray's log monitor forwards from workers of earlier jobs in this session: not the command's own."""


def _stderr_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.strip().splitlines() if not RAY_LOG_LINE.match(line)]


def _cfg(out: Path, **extra):
    return parse_config(_data(out, **extra), root=SyntheticConfig)


def _data(out: Path, **extra) -> dict:
    return {
        "name": "syn", "process": {"factors": [{"kind": "mess3"}]},
        "model": {"arch": "transformer", "n_layers": 2, "d_model": 32, "n_heads": 2, "d_mlp": 64, "context": 8},
        "training": {"steps": 150, "batch_size": 256, "lr": 0.003, "n_checkpoints": 4, "checkpoint_every": 50,
                     "eval_every": 50, "eval_sequences": 512},
        "analysis": {"sequences": 400, "vary_one_sequences": 100, "random_models": 2},
        "output": {"dir": str(out), "run_id": "syn", "report": True},
        "resources": {"num_workers": 1, "cpus_per_worker": 1}, **extra}


@pytest.fixture(scope="module")
def mess3(tmp_path_factory, ray_local):
    """The short Mess3 run, trained, analysed and reported: checked below, the clean curve a resumed copy of it
    must give, and another run's checkpoints for a run to refuse (each Ray Train trial saved costs 12 to 22
    CPU-seconds of start and stop: docs/benchmarks.md)."""
    from actlake.jobs.train.synthetic.job import run_synthetic

    return run_synthetic(_cfg(tmp_path_factory.mktemp("mess3")))


def test_short_mess3_run_learns_and_is_analysed(mess3):
    from actlake.storage.checkpoints import list_checkpoints, log_spaced_steps

    res = mess3
    assert Path(res.report).is_file()
    con = open_run(res.run_dir)
    curve = con.execute("SELECT step, eval_loss, optimal_loss FROM training_curves ORDER BY step").fetchall()
    (s0, l0, opt), (s1, l1, _) = curve[0], curve[-1]
    assert (s0, s1) == (0, 150) and opt < l1 < l0
    assert l1 - opt < 0.5 * (l0 - opt)  # more than half of the gap to the Bayes-optimal loss closed
    r2 = dict(con.execute("""SELECT step, r2 FROM factored_fit WHERE target = 'factor0' AND kind = 'checkpoint'""").fetchall())
    random_r2 = [r for (r,) in con.execute("SELECT r2 FROM factored_fit WHERE target = 'factor0' AND kind = 'random'").fetchall()]
    assert r2[150] > r2[0] and r2[150] > max(random_r2)
    # checkpoints kept at the log-spaced steps (and the previous resume checkpoint), as save_pretrained folders;
    # the analysis reads the log-spaced ones
    kept = [s for s, _ in list_checkpoints(Path(res.run_dir) / "checkpoints" / "transformer")]
    assert set(log_spaced_steps(150, 4)) <= set(kept)
    analysed = [s for (s,) in con.execute("SELECT DISTINCT step FROM factored_dimension WHERE kind = 'checkpoint' "
                                          "ORDER BY step").fetchall()]
    assert analysed == log_spaced_steps(150, 4)
    dims = con.execute("""SELECT DISTINCT factored_reference, joint_reference FROM factored_dimension""").fetchall()
    assert dims == [(2, 2)]  # one Mess3 factor: d - 1 = 2 both ways
    ov = con.execute("SELECT overlap FROM factor_overlap WHERE factor_i = 0 AND factor_j = 0").fetchall()
    assert np.allclose([o for (o,) in ov], 1.0)  # a subspace overlaps itself fully
    # the analysed sequences' token ids are stored: 400 sampled (behind the activations) and the vary-one set
    sets = dict(con.execute("SELECT sequence_set, count(*) FROM analysis_tokens GROUP BY sequence_set").fetchall())
    assert sets == {"sampled": 400, "vary0": 100}
    lens, lo, hi = con.execute("SELECT min(len(tokens)), min(list_min(tokens)), max(list_max(tokens)) "
                               "FROM analysis_tokens").fetchall()[0]
    assert (lens, lo, hi) == (8, 0, 2)  # context 8, Mess3's three tokens
    if CHROMIUM:  # the report draws every chart offline in a real browser
        seen = open_report(res.report)
        assert seen["errors"] == [] and len(seen["charts"]) == 5 and min(seen["marks"]) > 3
        assert all(u.startswith("file://") for u in seen["requests"])


def test_rerun_resumes_and_a_changed_process_is_refused(mess3, tmp_path, ray_local, capsys, caplog):
    import shutil

    import yaml

    from actlake.errors import StorageError
    from actlake.jobs.cli import main
    from actlake.jobs.train.synthetic.job import run_synthetic
    from actlake.storage.checkpoints import list_checkpoints

    cfg = _cfg(tmp_path, analysis={"enabled": False})  # the same training as the module's run (analysis aside)
    shutil.copytree(mess3.run_dir, cfg.run_dir)
    q = "SELECT step, train_loss, eval_loss FROM training_curves ORDER BY step"
    clean = open_run(cfg.run_dir).execute(q).fetchall()
    # as a worker killed right after step 0 leaves it: only the step-0 checkpoint
    for step, path in list_checkpoints(Path(cfg.run_dir) / "checkpoints" / "transformer"):
        if step:
            shutil.rmtree(path)
    tables = {p: p.read_bytes() for p in (Path(cfg.run_dir) / "tables").rglob("*") if p.is_file()}
    # issue 18.3: --analysis-only refuses an unfinished run (one line, before Ray starts)
    config = tmp_path / "syn.yaml"
    config.write_text(yaml.safe_dump(_data(tmp_path, analysis={"enabled": False})))
    capsys.readouterr()
    assert main(["train-synthetic", str(config), "--analysis-only"]) == 2
    err = _stderr_lines(capsys)
    assert len(err) == 1 and "training is unfinished (transformer at step 0 of 150)" in err[0], err
    assert f"actlake train-synthetic {config}` without --analysis-only" in err[0]
    assert {p: p.read_bytes() for p in (Path(cfg.run_dir) / "tables").rglob("*") if p.is_file()} == tables
    # issue 18.2: resuming with another world size is refused
    with pytest.raises(StorageError, match=r"resources\.num_workers \(1 -> 2\)"):
        run_synthetic(_cfg(tmp_path, analysis={"enabled": False}, resources={"num_workers": 2, "cpus_per_worker": 1}),
                      report=False)
    # issue 18.5: resumed from the step-0 checkpoint, the curve equals the clean one (step 0 once)
    run_synthetic(cfg, report=False)
    resumed = open_run(cfg.run_dir).execute(q).fetchall()
    assert [r[0] for r in resumed] == [r[0] for r in clean]
    np.testing.assert_allclose(np.array([r[2] for r in resumed]), np.array([r[2] for r in clean]), rtol=1e-5)
    before = (Path(cfg.run_dir) / "tables" / "training_curves").rglob("*.parquet")
    snap = {p: p.read_bytes() for p in before}
    with caplog.at_level(logging.INFO, logger="actlake.synthetic"):
        run_synthetic(cfg, report=False)  # every trial already at its last step: no trial starts
    assert {p: p.read_bytes() for p in snap} == snap
    assert "trained to step 150 already: transformer" in caplog.text and "training 1 trial" not in caplog.text
    changed = _cfg(tmp_path, analysis={"enabled": False}, process={"factors": [{"kind": "mess3", "x": 0.05}]})
    with pytest.raises(StorageError, match="different process"):
        run_synthetic(changed, report=False)


def test_analysis_only_and_resume_take_only_this_runs_whole_checkpoints(mess3, tmp_path, ray_local, capsys):
    """Issue 31, item 2: --analysis-only after a middle checkpoint is deleted or an older one damaged, and a
    resume onto checkpoints copied from another run (the module's: other training settings), each stop in one
    line naming the folder."""
    import shutil

    import yaml

    from actlake.jobs.cli import main
    from actlake.storage.checkpoints import list_checkpoints

    def job(seed: int, run_id: str) -> Path:
        data = _data(tmp_path / "runs")
        data["training"].update(steps=20, batch_size=32, n_checkpoints=3, checkpoint_every=10, eval_every=10,
                                eval_sequences=64, seed=seed)
        data["analysis"].update(sequences=50, vary_one_sequences=20, random_models=1)
        data["output"].update(run_id=run_id, report=False)
        path = tmp_path / f"{run_id}.yaml"
        path.write_text(yaml.safe_dump(data))
        return path

    a = job(0, "a")
    assert main(["train-synthetic", str(a), "--no-analysis"]) == 0
    ck_a, ck_b = tmp_path / "runs" / "a" / "checkpoints" / "transformer", Path(mess3.run_dir) / "checkpoints" / "transformer"
    steps = [s for s, _ in list_checkpoints(ck_a)]
    assert main(["train-synthetic", str(a), "--analysis-only"]) == 0
    capsys.readouterr()
    middle = ck_a / f"step-{steps[1]:08d}"
    aside = tmp_path / "aside"
    shutil.move(middle, aside)
    assert main(["train-synthetic", str(a), "--analysis-only"]) == 2
    assert _stderr_lines(capsys)[-1].startswith(f"actlake: error: {middle}: missing")
    shutil.move(aside, middle)
    state = middle / "model" / "model.safetensors"
    state.write_bytes(state.read_bytes()[:-100])  # truncated
    assert main(["train-synthetic", str(a), "--analysis-only"]) == 2
    assert _stderr_lines(capsys)[-1].startswith(f"actlake: error: {state}: ")
    # run b's checkpoints in run a's folder: refused before training resumes from them
    shutil.rmtree(ck_a)
    shutil.copytree(ck_b, ck_a)
    assert main(["train-synthetic", str(a)]) == 2
    line = _stderr_lines(capsys)[-1]
    assert line.startswith(f"actlake: error: {ck_a}/step-") and "a checkpoint of another run or trial: config" in line
