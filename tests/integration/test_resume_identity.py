"""One model and one code version per run (issue 50): a run stopped and resumed after the model's weights or a
custom analysis's code changed is refused by name before anything runs, and resumes once they are back; a
finished sweep rerun after a checkpoint's weights changed is refused and keeps its record."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from actlake.jobs.cli import main
from tests.conftest import committed_ids, drop_commits, job_config

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.usefixtures("kept_workers")]
ROOT = Path(__file__).resolve().parents[2]
LIGHT = {"analyses.contributions": False, "analyses.geometry": False, "analyses.attention_by_distance": False,
         "corpus.max_docs": 12, "sharding.docs_per_shard": 3, "sharding.commit_seconds": 0.001}


def _move_weights(folder: Path, seed: int = 1) -> None:
    """Save the folder's model again with every weight moved: other numbers, the same files."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(folder)


def _run(capsys, cfg, tmp_path: Path, run_id: str = "r") -> tuple[int, str]:
    """``actlake run`` on ``cfg``: (exit status, the one ``actlake: error:`` line or '')."""
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    code = main(["run", str(path), "--run-id", run_id, "--no-report"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("actlake: error:")]
    assert len(lines) == (code != 0), err[-3000:]
    return code, lines[0] if lines else ""


def test_a_resume_under_other_weights_is_refused_and_the_same_weights_resume(tiny_models, sample_corpus, tmp_path,
                                                                             capsys, ray_local):
    model = tmp_path / "model"
    shutil.copytree(tiny_models["gpt2"], model)
    original = (model / "model.safetensors").read_bytes()
    cfg = job_config(model, sample_corpus, tmp_path / "runs", **LIGHT)
    assert _run(capsys, cfg, tmp_path) == (0, "")
    run = tmp_path / "runs" / "r"
    killed = drop_commits(run, [2, 3])  # stopped before its last shards committed
    assert killed
    _move_weights(model)
    assert (model / "model.safetensors").read_bytes() != original
    code, line = _run(capsys, cfg, tmp_path)
    assert code == 2 and "model file model.safetensors: content changed" in line and "mix two models" in line, line
    assert committed_ids(run) == set(range(4)) - killed  # nothing ran under the new weights
    (model / "model.safetensors").write_bytes(original)  # the same bytes again (a newer mtime): the same model
    assert _run(capsys, cfg, tmp_path) == (0, "")
    assert committed_ids(run) == set(range(4))


def test_a_resume_under_changed_custom_code_is_refused(minilm_path, sample_corpus, tmp_path, capsys, ray_local):
    module = tmp_path / "code" / "attention_entropy.py"
    module.parent.mkdir()
    module.write_text((ROOT / "configs" / "attention_entropy.py").read_text())
    cfg = job_config(minilm_path, sample_corpus, tmp_path / "runs", **LIGHT, **{
        "analyses.custom": [{"analysis": "attention_entropy:AttentionEntropy", "path": str(module)}]})
    assert _run(capsys, cfg, tmp_path) == (0, "")
    run = tmp_path / "runs" / "r"
    killed = drop_commits(run, [3])
    module.write_text(module.read_text().replace("entropy_sum", "entropy_total"))  # a new version of the analysis
    code, line = _run(capsys, cfg, tmp_path)
    assert code == 2 and "custom analysis attention_entropy:AttentionEntropy's code changed" in line, line
    assert "mix two code versions" in line and committed_ids(run) == set(range(4)) - killed


def test_a_finished_sweep_rerun_after_a_checkpoint_changed_is_refused_and_keeps_its_record(tiny_models, sample_corpus,
                                                                                         tmp_path, capsys, ray_local):
    points = []
    for step in (0, 10):
        folder = tmp_path / f"step{step}"
        shutil.copytree(tiny_models["gpt2"], folder)
        if step:
            _move_weights(folder)
        points.append({"path": str(folder), "step": step})
    cfg = job_config(points[0]["path"], sample_corpus, tmp_path / "runs",
                     **{**LIGHT, "corpus.max_docs": 6, "model.checkpoints": points})
    assert _run(capsys, cfg, tmp_path, "sweep") == (0, "")
    record = (tmp_path / "runs" / "sweep" / "sweep.json").read_bytes()
    _move_weights(tmp_path / "step10", seed=2)
    code, line = _run(capsys, cfg, tmp_path, "sweep")
    assert code == 2 and "model file model.safetensors: content changed" in line and "'step-10'" in line, line
    assert (tmp_path / "runs" / "sweep" / "sweep.json").read_bytes() == record
    assert json.loads(record)["checkpoints"][1]["checkpoint"] == "step-10"
