"""A model split by ``model.device_map``: layers in CPU memory and offloaded to disk (accelerate's hooks
bring them back for their forward pass), or on two devices (with a GPU). The statistics must equal the
unsplit model's: on one device the same float32 operations run on the same weights, so the tolerance is
float32 rounding of the sums (1e-6 of each field's largest value); observed: identical."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from actlake.batching import Window
from actlake.config import parse_config
from actlake.model import load_model

pytestmark = pytest.mark.integration

REL = 1e-6
"""Largest |split - unsplit| allowed, relative to the field's largest |unsplit| value."""


def _where_layers_went(placement: dict) -> set[str]:
    """Devices that received at least one transformer block."""
    return {str(d) for name, d in placement.items() if ".layers" in name or name.endswith(("layers", ".h"))}


def offloading_max_memory(model_path, tmp_path) -> int:
    """A CPU budget (bytes) under which device_map: auto keeps some blocks in CPU memory and sends the
    others to disk: the model's size times falling fractions, the first that splits the blocks."""
    total = sum(p.stat().st_size for p in model_path.glob("*.safetensors"))
    for frac in np.arange(0.95, 0.2, -0.05):
        budget = int(total * frac)
        lm = _load(model_path, tmp_path / f"probe-{frac:.2f}", budget)
        if _where_layers_went(lm.placement) >= {"cpu", "disk"}:
            return budget
    pytest.fail(f"no CPU budget split the blocks of {model_path} between memory and disk")


def _model_section(model_path, offload=None, budget=None) -> dict:
    m = {"name_or_path": str(model_path), "dtype": "float32"}
    if budget is not None:
        m.update(device_map="auto", max_memory={"cpu": budget}, offload_folder=str(offload))
    return m


def _load(model_path, offload, budget):
    cfg = parse_config({"model": _model_section(model_path, offload, budget)})
    return load_model(cfg.model, lm_head=None)


def _windows(lm, n=(20, 32, 9, 27)):
    g = torch.Generator().manual_seed(0)
    return [Window(i, 0, torch.randint(5, len(lm.tokenizer) - 1, (k,), generator=g).tolist(), "s") for i, k in enumerate(n)]


def _assert_same(a, b, what):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, what
    scale = max(np.nanmax(np.abs(a)), 1e-30) if a.size else 1.0
    np.testing.assert_allclose(b, a, rtol=0, atol=REL * scale, equal_nan=True, err_msg=what)


def _assert_batches_equal(a, b):
    """Every statistic of two BatchResults (sums field by field, moments by their four fields), residual
    norms and surprisal."""
    moments = [(n, a.stats[n], b.stats[n]) for n in a.stats if not hasattr(a.stats[n], "_tensor_fields")]
    if getattr(a, "moments", None) is not None:
        moments.append(("moments", a.moments, b.moments))
    assert a.stats.keys() == b.stats.keys() and a.stats and moments
    for name in a.stats:
        x, y = a.stats[name], b.stats[name]
        for f in x._tensor_fields() if hasattr(x, "_tensor_fields") else ():
            _assert_same(getattr(x, f).cpu(), getattr(y, f).cpu(), f"{name}.{f}")
    for name, x, y in moments:
        for f in ("count", "mean", "m2", "max_abs"):
            _assert_same(getattr(x.moments, f).cpu(), getattr(y.moments, f).cpu(), f"{name}.{f}")
    _assert_same(a.parts["residual_norms"].norms, b.parts["residual_norms"].norms, "residual norms")
    _assert_same(a.surprisal, b.surprisal, "surprisal")


def _extract(lm, model_path):
    from actlake.jobs.extract.driver import Extractor

    cfg = parse_config({"model": {"name_or_path": str(model_path)}, "tokenization": {"max_length": 32},
                        "analyses": {"tokens": False}})
    return Extractor(cfg, lm).forward.run_batch(_windows(lm))


@pytest.mark.parametrize("family", ["gpt_neox", "llama"])
def test_blocks_offloaded_to_disk_give_the_unsplit_statistics(family, tiny_models, tmp_path):
    path = tiny_models[family]
    budget = offloading_max_memory(path, tmp_path)
    whole = load_model(parse_config({"model": _model_section(path)}).model, lm_head=None)
    split = _load(path, tmp_path / "offload", budget)
    assert _where_layers_went(split.placement) >= {"cpu", "disk"}, split.placement
    assert any(p.device.type == "meta" for p in split.model.parameters())  # really offloaded
    assert split.device == torch.device("cpu")
    _assert_batches_equal(_extract(whole, path), _extract(split, path))
    split.close()
    assert not (tmp_path / "offload").exists() or not any((tmp_path / "offload").iterdir())


def test_a_job_with_an_offloaded_model_gives_the_unsplit_tables(tiny_models, sample_corpus, tmp_path, ray_local):
    """The whole path: YAML -> actlake run (real Ray worker) -> tables, against the same job unsplit."""
    from actlake.jobs.cli import main
    from actlake.storage.sql import open_run
    from tests.conftest import job_config

    path = tiny_models["gpt_neox"]
    budget = offloading_max_memory(path, tmp_path)
    runs = {}
    for name, extra in (("whole", {}), ("split", {"model.device_map": "auto", "model.max_memory": {"cpu": budget},
                                                   "model.offload_folder": str(tmp_path / "offload")})):
        cfg = job_config(path, sample_corpus, tmp_path / "runs", **{"corpus.max_docs": 8, "output.run_id": name,
                                                                    "model.dtype": "float32", **extra})
        yaml_path = tmp_path / f"{name}.yaml"
        yaml_path.write_text(json.dumps(cfg.to_dict()))  # JSON is YAML
        assert main(["run", str(yaml_path)]) == 0
        runs[name] = open_run(str(cfg.run_dir))
    assert not any((tmp_path / "offload").iterdir())  # each worker removed its offload folder
    for table in ("tokens", "residual_norms", "dim_moments", "attention_mass", "contributions", "attention_geometry",
                  "attention_by_distance"):
        q = f"SELECT * EXCLUDE (shard) FROM {table} ORDER BY ALL" if table in ("tokens", "residual_norms") \
            else f"SELECT * FROM {table} ORDER BY ALL"
        a, b = runs["whole"].sql(q).df(), runs["split"].sql(q).df()
        assert len(a) == len(b) > 0 and list(a.columns) == list(b.columns), table
        for col in a.columns:
            if a[col].dtype.kind == "f":
                _assert_same(a[col].to_numpy(), b[col].to_numpy(), f"{table}.{col}")
            else:
                assert (a[col].to_numpy() == b[col].to_numpy()).all(), f"{table}.{col}"
    summary = json.loads((tmp_path / "runs" / "split" / "summary.json").read_text())
    assert summary["dtype"] == "float32"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: blocks on two devices")
@pytest.mark.parametrize("family", ["gpt_neox", "llama"])
def test_blocks_on_two_devices_give_the_unsplit_statistics(family, tiny_models):
    """Embeddings and block 0 in CPU memory and run there, block 1, the final norm and the LM head on the
    GPU: each layer's analyses run where the layer lives and add into accumulators on the CPU. The GPU
    computes in a different order (and may use TF32 for float32 products: off here), so the tolerance is
    1e-4 of each field's largest value."""
    from accelerate import dispatch_model
    from transformers import AutoModelForCausalLM

    from actlake.model import LoadedModel

    path = tiny_models[family]
    whole = load_model(parse_config({"model": _model_section(path)}).model, lm_head=None)
    causal = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    base = causal.base_model_prefix
    placement = {n: 0 for n, _ in causal.named_children() if n != base}  # the LM head
    placement.update({f"{base}.{n}": 0 for n, _ in causal.base_model.named_children() if n != "layers"})
    placement[f"{base}.{'embed_in' if family == 'gpt_neox' else 'embed_tokens'}"] = "cpu"
    placement.update({f"{base}.layers.0": "cpu", f"{base}.layers.1": 0})
    # main_device cpu: the blocks placed on "cpu" run there (not offloaded to the GPU)
    causal = dispatch_model(causal, device_map=placement, main_device="cpu")
    split = LoadedModel(causal.base_model, whole.tokenizer, whole.family, torch.device("cpu"), str(path),
                        causal.get_output_embeddings(), placement)
    assert {p.device.type for p in causal.parameters()} == {"cpu", "cuda"}
    torch.backends.cuda.matmul.allow_tf32 = False
    a, b = _extract(whole, path), _extract(split, path)
    global REL
    saved, REL = REL, 1e-4
    try:
        _assert_batches_equal(a, b)
    finally:
        REL = saved


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: blocks offloaded to CPU memory run on it")
def test_blocks_offloaded_to_cpu_memory_on_a_gpu_give_the_unsplit_statistics(tiny_models):
    """model.max_memory with a GPU budget smaller than the model: accelerate keeps the rest in CPU memory
    (parameters on the meta device) and runs those blocks on the GPU; the key weights the contributions
    need are read from the offloaded copy. Against the whole model on the same GPU (float32, TF32 off)."""
    path = tiny_models["gpt_neox"]
    total = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    torch.backends.cuda.matmul.allow_tf32 = False
    whole = load_model(parse_config({"model": {**_model_section(path), "device": "cuda"}}).model, lm_head=None)
    assert whole.device.type == "cuda" and whole.dtype == torch.float32
    for frac in np.arange(0.9, 0.2, -0.1):
        cfg = parse_config({"model": {**_model_section(path), "device_map": "auto",
                                      "max_memory": {0: int(total * frac), "cpu": 10 * total}}})
        split = load_model(cfg.model, lm_head=None)
        if _where_layers_went(split.placement) >= {"0", "cpu"}:
            break
    else:
        pytest.fail("no GPU budget split the blocks between the GPU and CPU memory")
    assert split.device == torch.device("cuda", 0)
    assert any(p.device.type == "meta" for p in split.model.parameters())
    _assert_batches_equal(_extract(whole, path), _extract(split, path))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_dtype_auto_loads_bfloat16_straight_onto_the_gpu(tiny_models):
    lm = load_model(parse_config({"model": {"name_or_path": str(tiny_models["llama"])}}).model, lm_head=None)
    assert lm.dtype == (torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float32)
    assert {p.device.type for p in lm.model.parameters()} == {"cuda"} and lm.lm_head.weight.device.type == "cuda"
