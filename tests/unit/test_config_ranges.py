"""Bounds on single config fields are pydantic constraints (``Field(ge=..., lt=...)``, floats finite): a value out
of range, NaN or infinity is refused in one line naming the dotted key, the value and the bound; the bound itself
(or, for a strict bound, a value just inside it) is accepted."""

from __future__ import annotations

import math

import pytest

from actlake.config import load_config, parse_config
from actlake.errors import ConfigError
from actlake.jobs.train.lm.config import MAX_VOCAB, LMConfig
from actlake.jobs.train.predictor.config import PredictorJobConfig
from actlake.jobs.train.synthetic.config import SyntheticConfig

NAN, INF = math.nan, math.inf

# (config root, dotted key, bad values with the bound the message must name, a value at or just inside the bound)
CASES = [
    (None, "tokenization.max_length", [(3, "at least 4"), (-1, "at least 4")], 4),
    (None, "corpus.max_line_bytes", [(1023, "at least 1,024")], 1024),
    (None, "activations.fraction", [(0.0, "in (0, 1]"), (1.5, "in (0, 1]"), (NAN, "finite and in (0, 1]"),
                                    (INF, "finite and in (0, 1]")], 1.0),
    (None, "sharding.commit_seconds", [(0.0, "more than 0"), (-5, "more than 0"), (NAN, "finite"), (INF, "finite")], 1e-3),
    (None, "resources.memory_per_worker_gb", [(-1, "more than 0"), (NAN, "finite"), (INF, "finite")], 0.5),
    (None, "resources.cpus_per_worker", [(-1, "at least 0"), (NAN, "finite and at least 0")], 0.0),
    (LMConfig, "training.eval_fraction", [(0.5, "in (0, 0.5)"), (0.0, "in (0, 0.5)"), (NAN, "finite"), (-INF, "finite")],
     0.49),
    (LMConfig, "training.seq_len", [(7, "at least 8")], 8),
    (LMConfig, "tokenizer.vocab_size", [(MAX_VOCAB + 1, "at most 1,048,576")], MAX_VOCAB),
    (LMConfig, "training.lr", [(0.0, "positive"), (-1e-3, "positive"), (NAN, "finite"), (INF, "finite")], 1e-9),
    (LMConfig, "training.weight_decay", [(-0.1, "at least 0"), (INF, "finite and at least 0")], 0.0),
    (LMConfig, "training.warmup_steps", [(-1, "at least 0")], 0),
    (LMConfig, "resources.cpus_per_worker", [(0, "more than 0"), (INF, "finite")], 0.25),
    (PredictorJobConfig, "predictor.steps", [(0, "at least 1")], 1),
    (PredictorJobConfig, "predictor.eval_fraction", [(1.0, "in (0, 1)"), (NAN, "finite")], 0.99),
    (SyntheticConfig, "model.context", [(1, "at least 2")], 2),
    (SyntheticConfig, "training.n_checkpoints", [(1, "at least 2")], 2),
    (SyntheticConfig, "training.eval_sequences", [(0, "at least 1")], 1),
    (SyntheticConfig, "process.noise", [(1.5, "in [0, 1]"), (-0.1, "in [0, 1]"), (NAN, "finite and in [0, 1]")], 1.0),
    (SyntheticConfig, "analysis.threshold", [(1.0, "in (0, 1)"), (INF, "finite")], 0.999),
]


def _data(key: str, value) -> dict:
    section, name = key.split(".")
    return {section: {name: value}}


def _refusal(root, data) -> str:
    with pytest.raises(ConfigError) as e:
        parse_config(data, root=root)
    return str(e.value)


@pytest.mark.parametrize("root,key,bad,ok", CASES, ids=[f"{(r or type('JobConfig', (), {})).__name__}-{k}"
                                                        for r, k, _, _ in CASES])
def test_a_value_out_of_range_is_one_line_naming_key_value_and_bound(root, key, bad, ok):
    for value, bound in bad:
        msg = _refusal(root, _data(key, value))
        assert "\n" not in msg, msg
        assert f"'{key}': must be " in msg and bound in msg and msg.endswith(f", got {value!r}"), msg
    cfg = parse_config(_data(key, ok), root=root)
    section, name = key.split(".")
    assert getattr(getattr(cfg, section), name) == ok


@pytest.mark.parametrize("root,key,value,bad,bound", [
    (PredictorJobConfig, "probes.Cs", [0.1, 0.0], 1, "more than 0"),
    (PredictorJobConfig, "probes.Cs", [NAN], 0, "finite"),
    (PredictorJobConfig, "probes.source_caps", [10, 0, 5], 1, "at least 1"),
    (SyntheticConfig, "sweep.noise", [0.0, 1.5], 1, "in [0, 1]"),
    (SyntheticConfig, "sweep.noise", [INF], 0, "finite"),
])
def test_a_list_item_out_of_range_names_its_index(root, key, value, bad, bound):
    msg = _refusal(root, _data(key, value))
    assert "\n" not in msg and f"'{key}.{bad}': must be " in msg and bound in msg, msg
    assert msg.endswith(f", got {value[bad]!r}"), msg
    ok = [v if i != bad else (1 if key == "probes.source_caps" else 0.5) for i, v in enumerate(value)]
    section, name = key.split(".")
    assert getattr(getattr(parse_config(_data(key, ok), root=root), section), name) == ok


def test_cross_field_checks_stay_and_read_as_before():
    assert "'tokenization.stride': must be in [0, max_length/2), got 2" in _refusal(
        None, {"tokenization": {"max_length": 4, "stride": 2}})
    assert "'tokenization.stride': must be at least 0, got -1" in _refusal(None, {"tokenization": {"stride": -1}})
    assert "'probes.source_caps': must be three positive counts" in _refusal(
        PredictorJobConfig, {"probes": {"source_caps": [1, 2]}})
    assert "'probes.Cs': must be positive numbers, got []" in _refusal(PredictorJobConfig, {"probes": {"Cs": []}})
    assert "'tokenizer.vocab_size': must be at least 300" in _refusal(LMConfig, {"tokenizer": {"vocab_size": 299}})


def test_yaml_nan_and_inf_name_the_file_and_line(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("name: j\nsharding:\n  docs_per_shard: 8\n  commit_seconds: .inf\nactivations:\n  fraction: .nan\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, check_files=False)
    assert str(e.value) == f"{path}, line 4: 'sharding.commit_seconds': must be finite and positive (more than 0), got inf"
