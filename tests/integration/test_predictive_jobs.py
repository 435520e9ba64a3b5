"""train-lm and train-predictor end to end on real Ray Train: metrics equal scikit-learn / SciPy on the
job's own arrays, and a predictor whose worker is killed resumes from its checkpoint with the same curve."""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from actlake.config import parse_config
from actlake.jobs.cli import main
from actlake.jobs.extract.run import run_job
from actlake.jobs.train.lm.config import LMConfig
from actlake.jobs.train.predictor.config import PredictorJobConfig
from actlake.storage.sql import open_run
from tests.conftest import job_config, own_processes
from tests.integration.browser import CHROMIUM, open_report

pytestmark = [pytest.mark.integration, pytest.mark.slow]

OFF = {f"analyses.{k}": False for k in ("residual_norms", "dim_moments", "attention_mass", "contributions", "geometry",
                                         "attention_by_distance")}


RAY_LOG_LINE = re.compile(r"^(\x1b\[[0-9;]*m)?\((\w+ )?(pid=|raylet)")
"""Lines Ray's log monitor forwards from workers of earlier jobs in this session: not the command's own."""


def _stderr_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.strip().splitlines() if not RAY_LOG_LINE.match(line)]


@pytest.fixture(scope="module")
def store(tiny_models, sample_corpus, tmp_path_factory, ray_local):
    out = tmp_path_factory.mktemp("store")
    cfg = job_config(tiny_models["gpt_neox"], sample_corpus, out, **OFF, **{
        "corpus.max_docs": 40, "tokenization.max_windows_per_doc": 3, "activations.layers": [1, 2],
        "output.run_id": "store"})
    return run_job(cfg).run_dir


def _predictor_data(store, out: Path, run_id: str, **predictor) -> dict:
    p = {"steps": 60, "batch_size": 8, "eval_every": 20, "checkpoint_every": 20, "warmup_steps": 5, "lr": 0.003,
         "eval_fraction": 0.3, **predictor}
    return {"name": "p", "store": str(store), "layers": [1, 2], "predictor": p,
            "probes": {"source_caps": [30, 8, 8], "type8_totals": [60, 15, 15]},
            "output": {"dir": str(out), "run_id": run_id, "report": True},
            "resources": {"num_workers": 1, "cpus_per_worker": 1}}


def _predictor_cfg(store, out: Path, run_id: str, **predictor):
    return parse_config(_predictor_data(store, out, run_id, **predictor), root=PredictorJobConfig)


CURVE = {"steps": 160, "checkpoint_every": 20, "eval_every": 40}
"""The predictor settings of the finished run below and of the killed run compared with it."""


@pytest.fixture(scope="module")
def finished(store, tmp_path_factory, ray_local) -> dict:
    """A predictor run to its end, with probes and its report: its metrics are checked against scikit-learn and
    SciPy, and a killed run of the same settings against its curve."""
    from actlake.jobs.train.predictor.job import run_predictor_job

    return run_predictor_job(_predictor_cfg(store, tmp_path_factory.mktemp("predictor"), "finished", **CURVE))


def test_predictor_job_metrics_equal_sklearn_and_scipy(store, finished):
    from scipy.stats import spearmanr
    from sklearn.metrics import r2_score

    from actlake.jobs.train.predictor.loop import held_out
    from actlake.jobs.train.predictor.model import PredictorTrainer
    from actlake.storage.activations import read_windows
    from actlake.storage.checkpoints import latest_checkpoint

    res = finished
    if CHROMIUM:  # Figures 1-6 draw offline in a real browser
        seen = open_report(res["report"])
        assert seen["errors"] == [] and len(seen["charts"]) == 6 and min(seen["marks"]) > 3
        assert all(u.startswith("file://") for u in seen["requests"])
    con = open_run(res["run_dir"])
    for layer in (1, 2):
        summary = con.execute("SELECT r2, spearman, steps FROM predictor_summary WHERE layer = ?", [layer]).fetchall()[0]
        assert summary[2] == CURVE["steps"]
        toks = con.execute("SELECT residual_norm, surprisal, position FROM predictor_tokens WHERE layer = ?",
                           [layer]).fetchnumpy()
        assert summary[1] == pytest.approx(spearmanr(toks["residual_norm"], toks["surprisal"]).statistic, abs=1e-9)
        for pos, rho in con.execute("SELECT position, spearman FROM predictor_position WHERE layer = ? AND n_tokens > 3",
                                    [layer]).fetchall():
            sel = toks["position"] == pos
            assert rho == pytest.approx(spearmanr(toks["residual_norm"][sel], toks["surprisal"][sel]).statistic, abs=1e-9)
        # R²: the final checkpoint's predictions on the held-out windows, scored by scikit-learn
        h, valid, meta = read_windows(open_run(store), layer)
        ev = held_out(meta["doc_id"], meta["window_index"], 0.3)
        state = torch.load(latest_checkpoint(Path(res["run_dir"]) / "checkpoints" / f"layer{layer}")[1]
                           / "trainer_state.pt", weights_only=False)["trainer"]
        trainer = PredictorTrainer(*_trainer_args(state))
        trainer.load_state_dict(state)
        pred = trainer.predict(torch.from_numpy(h[ev]), torch.from_numpy(valid[ev]))  # (N, T-1, d)
        target = h[ev][:, 1:]
        ok = valid[ev][:, 1:] & valid[ev][:, :-1]
        assert summary[0] == pytest.approx(r2_score(target[ok], pred[ok], multioutput="variance_weighted"), abs=1e-5)
    f1 = con.execute("SELECT count(*), min(macro_f1), max(macro_f1) FROM probe_scores").fetchall()[0]
    assert f1[0] == 2 * 2 * 4 and 0 <= f1[1] <= f1[2] <= 1  # layers x tasks x representations


def _trainer_args(state):
    from actlake.jobs.train.predictor.model import PredictorConfig

    return PredictorConfig(**state["cfg"]), np.asarray(state["mean"]), np.asarray(state["std"])


def _ray_train_workers() -> list[int]:
    return own_processes("RayTrainWorker")


def test_killed_predictor_worker_resumes_with_the_same_curve(store, finished, tmp_path, ray_local, capsys):
    from actlake.errors import StorageError
    from actlake.jobs.train.predictor.job import run_predictor_job

    kw = CURVE
    clean = finished  # the same settings, run to the end without a kill (its probes leave the curve as it is)
    copy = Path(shutil.copytree(store, tmp_path / "store"))  # the same store, changed below
    data = _predictor_data(copy, tmp_path, "killed", **kw)
    data["layers"] = [1]  # one trial (its start and stop cost 12-22 CPU-seconds: docs/benchmarks.md), layer 1
    cfg = _without_probes(parse_config(data, root=PredictorJobConfig))
    ck = Path(cfg.run_dir) / "checkpoints"
    killed = []

    def killer():
        deadline = time.time() + 120
        while time.time() < deadline and not killed:
            if any(ck.glob("layer*/step-*")):
                for pid in _ray_train_workers():
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            time.sleep(0.02)

    t = threading.Thread(target=killer)
    t.start()
    res = run_predictor_job(cfg)
    t.join()
    assert killed, "no Ray Train worker was found to kill"
    a, b = open_run(clean["run_dir"]), open_run(res["run_dir"])
    q = "SELECT layer, step, train_mse, mse, r2 FROM predictor_curve WHERE layer = 1 ORDER BY layer, step"
    ca, cb = a.execute(q).fetchall(), b.execute(q).fetchall()
    assert ca and b.execute("SELECT DISTINCT layer FROM predictor_curve").fetchall() == [(1,)]
    assert [r[:2] for r in ca] == [r[:2] for r in cb]
    np.testing.assert_allclose(np.array([r[2:] for r in cb]), np.array([r[2:] for r in ca]), rtol=1e-5, atol=1e-8)
    resumed = [r[0] for r in b.execute("SELECT resumed_from FROM predictor_summary ORDER BY layer").fetchall()]
    assert any(len(x) > 0 and 0 < x[0] < kw["steps"] for x in resumed)  # really continued from a mid-run checkpoint
    b.close()
    # issue 18.8: rerunning the finished run adds no resume point and leaves no Ray Train state behind
    run_predictor_job(cfg)
    q = "SELECT layer, resumed_from FROM predictor_summary ORDER BY layer"
    assert [r[1] for r in open_run(res["run_dir"]).execute(q).fetchall()] == resumed
    assert not any((Path(res["run_dir"]) / "_ray_train").iterdir())
    # issue 18.7: the list column as CSV, not a traceback
    capsys.readouterr()
    assert main(["sql", res["run_dir"], q, "--format", "csv"]) == 0
    rows = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert rows[0] == ["layer", "resumed_from"] and [json.loads(r[1]) for r in rows[1:]] == resumed
    # issue 18.1: a store re-extracted under the same run id (here: one shard fewer) is refused
    _drop_last_shard(copy)
    with pytest.raises(StorageError, match="changed since the predictor run"):
        run_predictor_job(cfg)
    # ... and a store missing a committed shard file is refused, naming it
    _, _, _, entry = _shard_entries(copy)[0]
    (copy / entry["files"]["activations"]["path"]).unlink()
    with pytest.raises(StorageError, match="incomplete") as e:
        run_predictor_job(cfg)
    assert entry["files"]["activations"]["path"] in str(e.value) and "\n" not in str(e.value)


def _shard_entries(store: Path) -> list[tuple[Path, dict, int, dict]]:
    """(commit record path, record, shard id, the record's entry for that shard), by shard id."""
    out = []
    for path in sorted((store / "_complete").glob("group-*.json")):
        record = json.loads(path.read_text())
        out += [(path, record, int(sid), entry) for sid, entry in record["shards"].items()]
    return sorted(out, key=lambda x: x[2])


def _drop_last_shard(store: Path) -> None:
    """What a re-extraction of fewer documents leaves: a consistent, complete store with one shard fewer."""
    run = json.loads((store / "run.json").read_text())
    last = run["shards"].pop()
    (store / "run.json").write_text(json.dumps(run))
    path, record, _, entry = next(e for e in _shard_entries(store) if e[2] == last["shard_id"])
    for meta in entry["files"].values():
        (store / meta["path"]).unlink()
    del record["shards"][str(last["shard_id"])]
    if record["shards"]:
        path.write_text(json.dumps(record))
    else:  # its group held only that shard: a store without it has no such record
        path.unlink()


def _damage_copy(store: Path, dest: Path, how: str) -> tuple[Path, dict]:
    """A copy of ``store`` with one activation file changed: ``nan`` (one hidden-state value of a layer-2 row,
    its completion record updated as a writer would), ``truncate`` or ``flip`` (one byte in the middle).
    Returns the file and, for ``nan``, the row it hit."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from actlake.storage.parquet_io import write_parquet

    copy = Path(shutil.copytree(store, dest))
    record_path, record, _, entry = _shard_entries(copy)[1]
    meta = entry["files"]["activations"]
    path = copy / meta["path"]
    data, hit = path.read_bytes(), {}
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif how == "flip":
        path.write_bytes(data[: len(data) // 2] + bytes([data[len(data) // 2] ^ 0xFF]) + data[len(data) // 2 + 1 :])
    else:
        table = pq.read_table(path)
        k = int(np.flatnonzero(table.column("layer").to_numpy() == 2)[7])
        h = table.column("h").combine_chunks()
        flat = h.values.to_numpy(zero_copy_only=False).copy()
        flat[k * h.type.list_size + 3] = np.nan
        col = pa.FixedSizeListArray.from_arrays(pa.array(flat, h.type.value_type), h.type.list_size)
        write_parquet(table.set_column(table.schema.get_field_index("h"), "h", col), path)
        meta["bytes"] = path.stat().st_size
        record_path.write_text(json.dumps(record))
        hit = {k2: table.column(k2)[k].as_py() for k2 in ("doc_id", "window_index", "position")}
    return path, hit


@pytest.mark.parametrize("how", ["nan", "truncate", "flip", "nothing held out"])
def test_a_damaged_or_nonfinite_store_is_refused_before_ray(store, tmp_path, capsys, how):
    """Issue 18.4 / 18.6 / 18.7: one line naming the file (for NaN the row; for an empty evaluation split the
    key), exit 2, no training started."""
    if how == "nothing held out":
        shutil.copytree(store, tmp_path / "store")
        data = _predictor_data(tmp_path / "store", tmp_path / "runs", "p", eval_fraction=1e-12)
    else:
        path, hit = _damage_copy(Path(store), tmp_path / "store", how)
        data = _predictor_data(tmp_path / "store", tmp_path / "runs", "p")
    config = tmp_path / "p.yaml"
    config.write_text(yaml.safe_dump(data))
    capsys.readouterr()
    assert main(["train-predictor", str(config)]) == 2
    err = _stderr_lines(capsys)
    assert len(err) == 1 and err[0].startswith("actlake: error: "), err
    assert ("'predictor.eval_fraction'" in err[0]) if how == "nothing held out" else (path.name in err[0])
    if how == "nan":
        assert "non-finite" in err[0]
        assert (f"doc_id {hit['doc_id']}, window {hit['window_index']}, position {hit['position']}, layer 2"
                in err[0])
    assert not (tmp_path / "runs" / "p" / "checkpoints").exists()


def _without_probes(cfg):
    cfg.probes.enabled = False
    cfg.output.report = False
    return cfg


def test_train_lm_saves_a_loadable_model_that_learns(sample_corpus, tmp_path, ray_local, caplog, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actlake.errors import StorageError, TrainingError
    from actlake.jobs.train.lm.job import train_lm
    from actlake.storage.checkpoints import list_checkpoints

    cfg = parse_config({
        "name": "lm", "corpus": {"paths": [str(sample_corpus / "*.jsonl.zst")]},
        "tokenizer": {"vocab_size": 400},
        "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64},
        "training": {"steps": 60, "batch_size": 8, "seq_len": 32, "lr": 0.003, "warmup_steps": 5, "eval_every": 20,
                     "checkpoint_every": 20, "eval_fraction": 0.2, "snapshots": 3},
        "output": {"dir": str(tmp_path), "run_id": "lm"}, "resources": {"num_workers": 1, "cpus_per_worker": 1}},
        root=LMConfig)
    res = train_lm(cfg)
    model = AutoModelForCausalLM.from_pretrained(res["model"])
    tok = AutoTokenizer.from_pretrained(res["model"])
    assert model.config.model_type == "gpt_neox" and len(tok) == model.config.vocab_size == 400
    # training.snapshots: log-spaced models with the tokenizer, for a sweep; step 0 is the initial weights
    assert [s["step"] for s in res["snapshots"]] == [0, 7, 60]
    snaps = {s["step"]: AutoModelForCausalLM.from_pretrained(s["path"]).state_dict() for s in res["snapshots"]}
    assert all(AutoTokenizer.from_pretrained(s["path"]).get_vocab() == tok.get_vocab() for s in res["snapshots"])
    from actlake.jobs.train.lm.loop import build_model

    initial = build_model(cfg, 400, tok).state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(snaps[60][name], value) and torch.equal(snaps[0][name], initial[name]), name
    assert not all(torch.equal(snaps[7][n], snaps[0][n]) for n in initial)
    assert not all(torch.equal(snaps[7][n], snaps[60][n]) for n in initial)
    curve = open_run(Path(tmp_path) / "lm").execute("SELECT step, eval_loss FROM lm_curve ORDER BY step").fetchall()
    assert [s for s, _ in curve] == [20, 40, 60]
    assert curve[-1][1] < np.log(400) - 0.5  # well below the uniform-prediction loss
    run = Path(tmp_path) / "lm"
    ck = run / "checkpoints" / "lm"
    assert [s for s, _ in list_checkpoints(ck)] == [0, 7, 40, 60]  # the snapshots', and the previous one as a fallback
    assert not any((run / "_ray_train").iterdir())  # Ray Train's own state is not left behind
    (ck / ".tmp-00000080-deadbeef").mkdir()  # left by a worker killed while checkpointing
    capsys.readouterr()
    again = train_lm(cfg)  # a rerun finds the last step's checkpoint: no trial starts, the same model
    assert again["step"] == 60 and "train-lm: trained to step 60 already; nothing to train" in capsys.readouterr().out
    assert again["model"] == res["model"] and all(
        torch.equal(v, model.state_dict()[n]) for n, v in AutoModelForCausalLM.from_pretrained(again["model"]).state_dict().items())
    assert not list(ck.glob(".tmp-*")) and not any((run / "_ray_train").iterdir())
    # issue 18.2: a resume with another world size (another effective batch) is refused before Ray starts
    two = cfg.model_copy(update={"resources": cfg.resources.model_copy(update={"num_workers": 2})})
    with pytest.raises(StorageError, match=r"resources\.num_workers \(1 -> 2\)"):
        train_lm(two)
    # issue 18.6: a damaged newest checkpoint is named in the log and the previous one resumes, to the same curve
    state = ck / "step-00000060" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="actlake.training"):
        train_lm(cfg)
    assert str(state) in caplog.text and "falling back to the checkpoint of step 40" in caplog.text
    again_curve = open_run(run).execute("SELECT step, eval_loss FROM lm_curve ORDER BY step").fetchall()
    assert [s for s, _ in again_curve] == [s for s, _ in curve]
    np.testing.assert_allclose([v for _, v in again_curve], [v for _, v in curve], rtol=1e-5)
    for _, path in list_checkpoints(ck):  # nothing usable: one line naming a file, before Ray starts
        (path / "trainer_state.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(TrainingError, match="no usable checkpoint") as e:
        train_lm(cfg)
    assert "trainer_state.pt" in str(e.value) and "\n" not in str(e.value)


def test_train_lm_refuses_to_resume_on_a_changed_corpus(tmp_path, ray_local):
    """Issue 31, item 2: another corpus at the same path was accepted from the token cache, and with the cache
    deleted a new tokenizer was trained and the old weights resumed on it."""
    import shutil

    from actlake.corpus.sample import write_sample
    from actlake.errors import CorpusError
    from actlake.jobs.train.lm.job import train_lm

    corpus = tmp_path / "corpus"
    write_sample(corpus, n_docs=40, n_files=2)
    cfg = parse_config({
        "name": "lm", "corpus": {"paths": [str(corpus / "*.jsonl.zst")]}, "tokenizer": {"vocab_size": 300},
        "model": {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "intermediate_size": 32},
        "training": {"steps": 4, "batch_size": 4, "seq_len": 16, "warmup_steps": 1, "eval_every": 2,
                     "checkpoint_every": 2, "eval_fraction": 0.2},
        "output": {"dir": str(tmp_path / "runs"), "run_id": "lm"}, "resources": {"num_workers": 1, "cpus_per_worker": 1}},
        root=LMConfig)
    train_lm(cfg)
    run = tmp_path / "runs" / "lm"
    inputs = json.loads((run / "run.json").read_text())["inputs"]
    assert sorted(inputs) == sorted(str(p) for p in corpus.glob("*.jsonl.zst"))
    first = sorted(inputs)[0]
    shutil.rmtree(corpus)
    write_sample(corpus, n_docs=30, n_files=2)  # other documents, the same file names
    shutil.rmtree(run / "data")  # the token cache too: a new tokenizer would be trained
    with pytest.raises(CorpusError, match=rf"^{re.escape(first)}: .* since run 'lm' began"):
        train_lm(cfg)
