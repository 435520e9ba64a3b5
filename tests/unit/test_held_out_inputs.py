"""Held-out inputs of issue 31 (items 2 and 3): values out of range, files that are no files, command-line
arguments that are no arguments, and failures that are no ActlakeError. Each is one line before any work."""

from __future__ import annotations

import json
import os

import pytest

from actlake.config import load_config, parse_config
from actlake.errors import ConfigError
from actlake.jobs.cli import error_line, main


@pytest.mark.parametrize("section,key,value", [
    ("tokenization", "max_windows_per_doc", 0), ("tokenization", "min_tokens", -1), ("batching", "max_batch_size", 0),
    ("resources", "num_workers", -3), ("resources", "cpus_per_worker", -1), ("resources", "max_retries", -1),
    ("corpus", "max_docs", 0), ("corpus", "max_docs", -1)])
def test_extraction_values_out_of_range_name_their_key(section, key, value):
    with pytest.raises(ConfigError, match=rf"'{section}.{key}': must be"):
        parse_config({section: {key: value}})


@pytest.mark.parametrize("key,value", [("corpus.max_docs", 0), ("corpus.max_docs", -1),
                                       ("resources.num_workers", 0), ("resources.cpus_per_worker", 0)])
def test_training_values_out_of_range_name_their_key(key, value):
    """train-lm read ``corpus.max_docs: 0`` as every document and ``-1`` as one."""
    from actlake.jobs.train.lm.config import LMConfig

    section, name = key.split(".")
    with pytest.raises(ConfigError, match=rf"'{key}': must be"):
        parse_config({section: {name: value}}, root=LMConfig)


def test_a_missing_tokenizer_folder_is_one_line(tmp_path):
    from actlake.jobs.train.lm.config import LMConfig

    (tmp_path / "c.jsonl").write_text('{"text": "x"}\n')
    cfg = tmp_path / "lm.yaml"
    cfg.write_text(f"corpus:\n  paths: ['{tmp_path}/c.jsonl']\ntokenizer:\n  path: {tmp_path}/nothing\n")
    with pytest.raises(ConfigError, match=r"'tokenizer.path': no tokenizer folder at .*/nothing$"):
        load_config(cfg, root=LMConfig)


@pytest.mark.parametrize("kind", ["device", "fifo"])
def test_a_corpus_path_that_is_no_regular_file_is_refused_before_it_is_opened(tmp_path, kind):
    """/dev/zero was fingerprinted for ever; a FIFO blocked planning on open."""
    if kind == "fifo":
        path = tmp_path / "pipe.jsonl"
        os.mkfifo(path)
    else:
        path = "/dev/zero"
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"corpus:\n  paths: ['{path}']\n  format: jsonl\noutput:\n  dir: {tmp_path}/runs\n")
    with pytest.raises(ConfigError, match=r"corpus.paths\[0\]: .* is not a regular file"):
        load_config(cfg)


@pytest.mark.parametrize("argv,message", [
    (["corpus", "sample", "{tmp}/s", "--files", "0"], "--files: must be at least 1, got 0"),
    (["corpus", "sample", "{tmp}/s", "--docs", "0"], "--docs: must be at least 1, got 0"),
    (["corpus", "sample", "{tmp}/file"], "{tmp}/file exists and is not a folder"),
    (["sql", "{tmp}", "SELECT 1", "--format", "parquet", "-o", "/nonexistent/x.parquet"],
     "--output: folder /nonexistent does not exist"),
    (["sql", "{tmp}", "SELECT 1", "--max-temp-size", "bogus"], "--max-temp-size: expected bytes or a size"),
    (["sql", "{tmp}", "SELECT 1", "--timeout", "0"], "--timeout: must be more than 0 seconds"),
])
def test_bad_command_line_values_are_one_line_and_write_nothing(tmp_path, capsys, argv, message):
    (tmp_path / "file").write_text("")
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"actlake: error: {message.format(tmp=tmp_path)}"] or (
        len(err) == 1 and err[0].startswith(f"actlake: error: {message.format(tmp=tmp_path)}"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_any_other_failure_is_one_line_naming_where_with_the_traceback_in_a_file():
    try:
        json.loads("{")
    except ValueError as e:
        line = error_line(e)
    assert line.startswith("JSONDecodeError: Expecting property name") and "json/decoder.py:" in line
    log = line.rsplit("traceback in ", 1)[1]
    text = open(log).read()
    assert "Traceback (most recent call last)" in text and "json.loads" in text
    os.unlink(log)


def test_cpus_per_worker_beyond_every_node_is_refused_not_waited_for():
    """Ray's autoscaler said 'No available node types can fulfill resource request' for ever."""
    from actlake.jobs.extract.run import check_fits_a_node
    from actlake.jobs.train.training import Resources, check_fits

    nodes = [{"CPU": 4, "memory": 2**34}, {"CPU": 2}]
    check_fits_a_node(parse_config({"resources": {"cpus_per_worker": 4}}).resources, 0, nodes)
    with pytest.raises(ConfigError, match=r"resources.cpus_per_worker: 64 CPUs per worker, but no node .* more than 4"):
        check_fits_a_node(parse_config({"resources": {"cpus_per_worker": 64}}).resources, 0, nodes)
    check_fits(Resources(num_workers=3, cpus_per_worker=2), nodes)
    with pytest.raises(ConfigError, match=r"resources.cpus_per_worker: 8 CPUs per worker"):
        check_fits(Resources(num_workers=1, cpus_per_worker=8), nodes)
    with pytest.raises(ConfigError, match=r"resources.num_workers: 4 workers of 2 CPUs, but the cluster holds at most 3"):
        check_fits(Resources(num_workers=4, cpus_per_worker=2), nodes)
    with pytest.raises(ConfigError, match=r"resources.use_gpu: 1 workers need a GPU each, but the cluster has 0"):
        check_fits(Resources(num_workers=1, cpus_per_worker=1, use_gpu=True), nodes)


@pytest.mark.parametrize("matrices,message", [
    ([[[0.5, 0.5], [0.5]], [[0.0, 0.0], [0.0, 0.5]]], "not a numeric array"),
    ([[[float("nan"), 0.5], [0.5, 0.0]], [[0.0, 0.0], [0.0, 0.5]]], "expected a finite 3-d array")])
def test_a_ragged_or_nan_transition_matrix_is_one_line_before_ray(matrices, message):
    """Failed inside Ray after 3 tries (175 lines, no key named)."""
    from actlake.jobs.train.synthetic.config import SyntheticConfig

    with pytest.raises(ConfigError, match=rf"'process.factors.0.matrices': T: {message}"):
        parse_config({"process": {"factors": [{"kind": "matrices", "matrices": matrices}]}}, root=SyntheticConfig)


def test_analysis_only_with_no_analysis_is_refused_before_ray(tmp_path, capsys):
    cfg = tmp_path / "s.yaml"
    cfg.write_text("name: s\n")
    assert main(["train-synthetic", str(cfg), "--analysis-only", "--no-analysis"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "actlake: error: --analysis-only and --no-analysis together leave nothing to do; drop one"]
    assert list(tmp_path.iterdir()) == [cfg]


def test_a_huge_vocabulary_is_refused_in_the_config():
    """``tokenizer.vocab_size: 1000000000`` aborted the process in the tokenizer's allocator (exit 134)."""
    from actlake.jobs.train.lm.config import LMConfig

    with pytest.raises(ConfigError, match=r"'tokenizer.vocab_size': must be at most 1,048,576"):
        parse_config({"tokenizer": {"vocab_size": 10**9}}, root=LMConfig)


def test_a_tokenizer_without_eos_is_refused_before_the_corpus_is_read(tmp_path, minilm_path):
    """Failed with a TypeError after tokenising the whole corpus. MiniLM's BERT tokenizer has no EOS token."""
    from actlake.jobs.train.lm.config import LMConfig
    from actlake.jobs.train.lm.loop import build_token_streams

    (tmp_path / "c.jsonl").write_text('{"text": "one two"}\n')
    cfg = parse_config({"corpus": {"paths": [str(tmp_path / "c.jsonl")]}, "tokenizer": {"path": minilm_path}},
                       root=LMConfig)
    with pytest.raises(ConfigError, match=r"'tokenizer.path': the tokenizer at .* has no EOS token"):
        build_token_streams(cfg, tmp_path / "data")
    assert not (tmp_path / "data" / "train.npy").exists()
