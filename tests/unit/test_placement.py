"""Device placement settings: device_map, max_memory, GPUs and memory per worker, model.dtype auto."""

from __future__ import annotations

import pytest

from actlake.config import max_memory_map, memory_bytes, parse_config
from actlake.errors import ConfigError, StorageError


def _cfg(**sections):
    return parse_config(sections)


@pytest.mark.parametrize("data,key,words", [
    ({"model": {"max_memory": {0: "1GiB"}}}, "model.max_memory", "needs model.device_map"),
    ({"model": {"device_map": "auto", "max_memory": {"gpu0": "1GiB"}}}, "model.max_memory", "not a device"),
    ({"model": {"device_map": "auto", "max_memory": {0: "1 gigabyte"}}}, "model.max_memory", "30GiB"),
    ({"model": {"device_map": "auto", "max_memory": {"cpu": 0}}}, "model.max_memory", "more than 0"),
    ({"model": {"device_map": "auto", "max_memory": {}}}, "model.max_memory", "empty"),
    ({"model": {"device_map": "auto", "max_memory": [1]}}, "model.max_memory", "mapping"),
    ({"model": {"device_map": "everywhere"}}, "model.device_map", "expected auto"),
    ({"model": {"device_map": "auto", "max_memory": {1: "1GiB"}}}, "model.max_memory", "owns 1 GPU"),
    ({"model": {"offload_folder": "/tmp/x"}}, "model.offload_folder", "needs model.device_map"),
    ({"model": {"device_map": "auto", "device": "cpu"}}, "model.device_map", "cpu and disk only"),
    ({"resources": {"gpus_per_worker": 2}}, "resources.gpus_per_worker", "need model.device_map"),
    ({"resources": {"gpus_per_worker": 2.5}, "model": {"device_map": "auto"}}, "resources.gpus_per_worker", "whole number"),
    ({"resources": {"gpus_per_worker": 1}, "model": {"device": "cpu"}}, "resources.gpus_per_worker", "idle"),
    ({"resources": {"memory_per_worker_gb": -1}}, "resources.memory_per_worker_gb", "more than 0"),
])
def test_placement_settings_are_checked_with_one_line_naming_the_key(data, key, words):
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    msg = str(e.value)
    assert "\n" not in msg and f"'{key}'" in msg and words in msg


def test_max_memory_takes_yaml_keys_and_sizes_in_bytes(tmp_path):
    from actlake.config import load_config

    p = tmp_path / "job.yaml"
    p.write_text("model:\n  device_map: auto\n  max_memory: {0: 30GiB, 1: 2.5 GB, cpu: 1000}\n"
                 "resources:\n  gpus_per_worker: 2\n  memory_per_worker_gb: 64\n")
    cfg = load_config(p, check_files=False)
    assert cfg.model.max_memory == {"0": "30GiB", "1": "2.5 GB", "cpu": 1000}
    assert max_memory_map(cfg.model.max_memory) == {0: 30 * 2**30, 1: int(2.5e9), "cpu": 1000}
    assert memory_bytes("512MiB") == 512 * 2**20 and memory_bytes("1kb") == 1000  # bytes, never bits


def test_dtype_auto_is_bfloat16_on_a_bfloat16_gpu_and_float32_elsewhere(monkeypatch):
    import torch

    from actlake.config import ModelConfig
    from actlake.model import resolve_dtype

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert ModelConfig().dtype == "auto"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: not including_emulation or True)
    assert resolve_dtype(ModelConfig(), cuda) == torch.bfloat16
    assert resolve_dtype(ModelConfig(), cpu) == torch.float32
    assert resolve_dtype(ModelConfig(dtype="float32"), cuda) == torch.float32
    assert resolve_dtype(ModelConfig(dtype="float16"), cpu) == torch.float16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)  # e.g. a V100
    assert resolve_dtype(ModelConfig(), cuda) == torch.float32


def test_a_whole_model_goes_straight_to_its_gpu_and_a_split_one_gets_its_own_offload_folder(monkeypatch, tmp_path):
    import torch

    import actlake.model as model
    from actlake.config import ModelConfig

    monkeypatch.setattr(model, "pick_device", lambda cfg: torch.device("cuda", 0))
    assert model._placement_kwargs(ModelConfig()) == {"device_map": {"": "cuda:0"}}  # never all in host memory first
    monkeypatch.setattr(model, "pick_device", lambda cfg: torch.device("cpu"))
    assert model._placement_kwargs(ModelConfig()) == {}
    cfg = ModelConfig(device_map="auto", max_memory={"0": "1GiB", "cpu": "2GiB"}, offload_folder=str(tmp_path / "off"))
    a, b = model._placement_kwargs(cfg), model._placement_kwargs(cfg)
    assert a["max_memory"] == {0: 2**30, "cpu": 2 * 2**30} and a["device_map"] == "auto"
    assert a["offload_folder"] != b["offload_folder"]  # one per worker
    assert {p.parent for p in map(__import__("pathlib").Path, (a["offload_folder"], b["offload_folder"]))} == {tmp_path / "off"}


def test_inputs_go_to_the_first_gpu_of_a_split_model_or_the_cpu():
    import torch

    from actlake.model import main_device

    fake = lambda placement: type("M", (), {"hf_device_map": placement})()
    cpu = torch.device("cpu")
    assert main_device(fake({"embed": "cpu", "layers.0": 1, "layers.1": 0, "head": "disk"}), cpu) == torch.device("cuda", 1)
    assert main_device(fake({"embed": "cpu", "layers": "disk"}), torch.device("cuda", 0)) == cpu
    assert main_device(fake(None), torch.device("cuda", 0)) == torch.device("cuda", 0)


def test_quick_start_config_keeps_float32():
    from actlake.config import load_config

    assert load_config(None, check_files=False).model.dtype == "float32"


def test_missing_accelerate_is_one_error_line_before_ray_starts(tmp_path, monkeypatch, capsys):
    import importlib.util

    import actlake.jobs.extract.run as run
    from actlake.jobs.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real(name, *a))
    monkeypatch.setattr(run, "init_ray", lambda *a, **k: pytest.fail("Ray started"))
    (tmp_path / "c.jsonl").write_text('{"text": "hello"}\n')
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"model:\n  device_map: auto\ncorpus:\n  paths: ['{tmp_path}/c.jsonl']\noutput:\n  dir: {tmp_path}/runs\n")
    assert main(["run", str(cfg)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and err[0].startswith("actlake: error: model.device_map")
    assert "pip install accelerate" in err[0]


def test_worker_options_reserve_memory_and_refuse_workers_no_node_can_hold():
    from actlake.jobs.extract.run import check_fits_a_node, worker_options

    cfg = _cfg(model={"device_map": "auto"}, resources={"gpus_per_worker": 4, "memory_per_worker_gb": 96})
    opts = worker_options(cfg, 1.0, 4.0)
    assert opts["memory"] == 96 * 2**30 and opts["num_gpus"] == 4.0
    assert "memory" not in worker_options(_cfg(), 1.0, 0.0)
    nodes = [{"CPU": 8, "GPU": 8, "memory": 200 * 2**30}, {"CPU": 2, "memory": 8 * 2**30}]
    check_fits_a_node(cfg.resources, 4.0, nodes)
    with pytest.raises(ConfigError, match=r"resources.gpus_per_worker: 4 GPUs per worker, but no node .* more than 2"):
        check_fits_a_node(cfg.resources, 4.0, [{"GPU": 2, "memory": 2**40}])
    with pytest.raises(ConfigError, match=r"resources.memory_per_worker_gb: 96 GiB"):
        check_fits_a_node(cfg.resources, 4.0, [{"GPU": 8, "memory": 64 * 2**30}])


def test_shards_in_different_dtypes_are_not_merged(tmp_path):
    from actlake.jobs.extract.reduce import model_dtype
    from actlake.storage.layout import RunLayout

    layout = RunLayout(tmp_path)
    rec = lambda d: {"dtype": d}  # shard summaries
    assert model_dtype(layout, [rec("float32"), rec("float32")]) == "float32" and model_dtype(layout, []) is None
    with pytest.raises(StorageError, match="bfloat16, float32"):
        model_dtype(layout, [rec("float32"), rec("bfloat16")])
