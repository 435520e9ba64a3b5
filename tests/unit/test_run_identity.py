"""A run's identity (model files, actlake's sources, custom code): stable for the same inputs, and each change
named (the resumes themselves: tests/integration/test_resume_identity.py)."""

from __future__ import annotations

import copy

from actlake.jobs.extract.identity import actlake_code, identity_change, run_identity
from tests.conftest import job_config


def test_the_identity_is_stable_and_each_change_is_named(minilm_path, sample_corpus, tmp_path):
    cfg = job_config(minilm_path, sample_corpus, tmp_path)
    first, again = run_identity(cfg, {}), run_identity(cfg, {})
    assert first == again and identity_change(first, again) is None
    assert {"config.json", "model.safetensors"} <= set(first["model"]["files"])
    assert first["code"] == actlake_code() and len(first["code"]["sha256"]) == 64
    other = copy.deepcopy(first)
    other["code"]["sha256"] = "0" * 64
    assert identity_change(other, first) == f"actlake's code changed (version {first['code']['version']} both times, different sources)"
    other["code"]["version"] = "0.0.1"
    assert identity_change(other, first).startswith("actlake's code changed (0.0.1 then, ")
    gone = copy.deepcopy(first)
    gone["model"]["files"]["extra.safetensors"] = first["model"]["files"]["model.safetensors"]
    assert identity_change(gone, first) == "model file extra.safetensors is gone"
    hub = {**first, "model": {"hub": "org/model", "revision": None}}
    assert identity_change(hub, first) == "the model is a local folder now, org/model@main (from the hub) when the run began"


def test_the_same_bytes_touched_or_copied_are_the_same_model_and_other_bytes_are_not(tiny_models, tmp_path):
    """Every model file is hashed whole (a sampled hash would take a touched 90 MB file for a new one), once per
    version of the file: a touch rehashes and finds the same bytes."""
    import os
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_models["gpt2"], model)
    cfg = job_config(model, tmp_path, tmp_path / "out")
    first = run_identity(cfg, {})
    weights = model / "model.safetensors"
    os.utime(weights, ns=(1, 1))
    assert identity_change(first, run_identity(cfg, {})) is None
    copy = tmp_path / "copy"
    shutil.copytree(model, copy)
    assert identity_change(first, run_identity(job_config(copy, tmp_path, tmp_path / "out"), {})) is None
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert identity_change(first, run_identity(cfg, {})) == "model file model.safetensors: content changed"
