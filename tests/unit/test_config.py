import pytest

from actlake.cli import main
from actlake.config import load_config, parse_config, reference_markdown
from actlake.errors import ConfigError


def _write(tmp_path, text):
    p = tmp_path / "job.yaml"
    p.write_text(text)
    return p


def test_unknown_key_names_file_key_line_and_suggestion(tmp_path):
    p = _write(tmp_path, "name: x\nmodel:\n  dtyp: float32\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, check_files=False)
    msg = str(e.value)
    assert str(p) in msg and "line 3" in msg and "model.dtyp" in msg and "did you mean 'dtype'" in msg


def test_wrong_type_and_bad_choice(tmp_path):
    with pytest.raises(ConfigError, match=r"line 2.*'tokenization.max_length': expected an integer"):
        load_config(_write(tmp_path, "tokenization:\n  max_length: lots\n"), check_files=False)
    with pytest.raises(ConfigError, match=r"'model.dtype': expected one of"):
        load_config(_write(tmp_path, "model:\n  dtype: float8\n"), check_files=False)
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_write(tmp_path, "model: [\n"), check_files=False)


def test_fused_attention_weights_refuse_analyses_that_need_the_weights(tmp_path):
    p = _write(tmp_path, "analyses:\n  attention_weights: fused\n")
    with pytest.raises(ConfigError, match=r"line 2.*analyses.attention_weights.*weighted_contributions"):
        load_config(p, check_files=False)
    ok = "analyses:\n  attention_weights: fused\n  weighted_contributions: false\n  attention_by_distance: false\n"
    assert load_config(_write(tmp_path, ok), check_files=False).analyses.attention_weights == "fused"


def test_missing_corpus_file_and_model_folder(tmp_path):
    p = _write(tmp_path, f"corpus:\n  paths: [{tmp_path}/nothing/*.jsonl]\n")
    with pytest.raises(ConfigError, match=r"corpus.paths\[0\]: no file matches"):
        load_config(p)
    (tmp_path / "c.jsonl").write_text('{"text": "hi"}\n')
    p = _write(tmp_path, f"corpus:\n  paths: [{tmp_path}/c.jsonl]\nmodel:\n  name_or_path: {tmp_path}/no-model\n")
    with pytest.raises(ConfigError, match="model folder not found"):
        load_config(p)


def test_defaults_parse_and_run_id_is_stable():
    a = parse_config({"name": "x"})
    b = parse_config({"name": "x"})
    c = parse_config({"name": "x", "tokenization": {"max_length": 64}})
    assert a.run_id == b.run_id != c.run_id
    assert parse_config({"output": {"run_id": "mine"}}).run_id == "mine"


def test_cli_reports_one_clear_error(tmp_path, capsys):
    p = _write(tmp_path, "modle:\n  dtype: float32\n")
    assert main(["run", str(p)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown key 'modle'" in err[0] and "did you mean 'model'" in err[0]


def test_reference_lists_every_key():
    ref = reference_markdown()
    for key in ("model.name_or_path", "corpus.paths", "tokenization.stride", "batching.max_tokens", "resources.num_workers"):
        assert f"`{key}`" in ref
