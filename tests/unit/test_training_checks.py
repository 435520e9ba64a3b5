"""Training jobs fail early and in one line (issue 18): config values, token counts, checkpoints that
cannot be written or read. Everything here runs before Ray would start, so no Ray is needed."""

from __future__ import annotations

import re
import logging
from pathlib import Path

import pytest
import torch
import yaml

from actlake.jobs.cli import main
from actlake.errors import TrainingError
from actlake.storage.checkpoints import STATE_FILE, list_checkpoints, save_checkpoint


RAY_LOG_LINE = re.compile(r"^(\x1b\[[0-9;]*m)?\((\w+ )?(pid=|raylet)")
"""Lines Ray's log monitor forwards from workers of earlier jobs in this session: not the command's own."""


def _stderr_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.strip().splitlines() if not RAY_LOG_LINE.match(line)]


def _write(folder: Path, value: float) -> None:
    torch.save({"step": int(value), "w": torch.full((1000,), value)}, folder / STATE_FILE)


def _one_error_line(capsys) -> str:
    err = _stderr_lines(capsys)
    assert len(err) == 1 and err[0].startswith("actlake: error: "), err
    return err[0]


def test_a_checkpoint_that_cannot_be_written_is_named_and_the_previous_one_kept(tmp_path):
    root = tmp_path / "ck"
    save_checkpoint(root, 20, lambda f: _write(f, 20))

    def onto_a_full_disk(folder: Path) -> None:  # /dev/full answers every write with ENOSPC, as a full disk does
        (folder / STATE_FILE).symlink_to("/dev/full")
        _write(folder, 40)

    with pytest.raises(TrainingError) as e:
        save_checkpoint(root, 40, onto_a_full_disk)
    msg = str(e.value)
    assert "step-00000040" in msg and "previous checkpoint is kept" in msg and "\n" not in msg
    assert [s for s, _ in list_checkpoints(root)] == [20]
    assert not list(root.glob(".tmp-*"))
    assert torch.load(root / "step-00000020" / STATE_FILE)["step"] == 20


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    from actlake.storage.checkpoints import MANIFEST, prepare_checkpoints

    root = tmp_path / "ck"
    for step in (20, 40):
        save_checkpoint(root, step, lambda f, s=step: _write(f, s))
    assert (root / "step-00000040" / MANIFEST).is_file()
    state = root / "step-00000040" / STATE_FILE
    state.write_bytes(state.read_bytes()[:100])  # a torn write
    (root / ".tmp-00000060-deadbeef").mkdir()  # left by a worker killed mid-write
    with caplog.at_level(logging.WARNING, logger="actlake.training"):
        assert prepare_checkpoints(root) == 20
    assert str(state) in caplog.text and "falling back to the checkpoint of step 20" in caplog.text
    assert [s for s, _ in list_checkpoints(root)] == [20] and not list(root.glob(".tmp-*"))
    # nothing usable left: one line naming the file and the cause
    other = root / "step-00000020" / STATE_FILE
    other.write_bytes(b"garbage")
    with pytest.raises(TrainingError, match=r"no usable checkpoint") as e:
        prepare_checkpoints(root)
    assert str(other) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(TrainingError, match=r"no usable checkpoint"):  # refused again: nothing silently starts over
        prepare_checkpoints(root)


def _lm_yaml(path: Path, corpus: Path, out: Path, **training) -> Path:
    data = {"name": "lm", "corpus": {"paths": [str(corpus / "*.jsonl.zst")]}, "tokenizer": {"vocab_size": 400},
            "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64},
            "training": {"steps": 10, "batch_size": 4, "seq_len": 32, "warmup_steps": 2, "eval_every": 5,
                         "checkpoint_every": 5, **training},
            "output": {"dir": str(out), "run_id": "lm"}, "resources": {"num_workers": 1, "cpus_per_worker": 1}}
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("job, section", [("train-lm", "training"), ("train-predictor", "predictor"),
                                          ("train-synthetic", "training")])
def test_a_negative_learning_rate_is_a_config_error(job, section, tmp_path, capsys):
    cfg = {"train-lm": {"name": "lm"}, "train-predictor": {"name": "p", "store": str(tmp_path)},
           "train-synthetic": {"name": "s"}}[job]
    cfg[section] = {"lr": -0.001}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main([job, str(path)]) == 2
    line = _one_error_line(capsys)
    assert str(path) in line and f"'{section}.lr'" in line and "positive" in line


@pytest.mark.parametrize("case", ["seq_len longer than the tokens", "one document"])
def test_token_counts_are_checked_against_seq_len_before_ray(case, sample_corpus, tmp_path, capsys):
    if case == "one document":
        path = _lm_yaml(tmp_path / "lm.yaml", sample_corpus, tmp_path / "runs")
        data = yaml.safe_load(path.read_text())
        data["corpus"]["max_docs"] = 1  # one document: one of the two splits has no tokens
        path.write_text(yaml.safe_dump(data))
    else:
        path = _lm_yaml(tmp_path / "lm.yaml", sample_corpus, tmp_path / "runs", seq_len=10**6)
    assert main(["train-lm", str(path)]) == 2
    line = _one_error_line(capsys)
    assert str(path) in line and "'training.seq_len'" in line
    run = tmp_path / "runs" / "lm"
    assert not (run / "checkpoints").exists() and not (run / "_ray_train").exists()  # refused before Ray Train ran


def test_a_checkpoint_of_another_run_or_trial_is_refused_naming_it(tmp_path):
    """Checkpoints copied from another run (another seed, so another config hash) were resumed silently."""
    from actlake.storage.checkpoints import checkpoint_identity, prepare_checkpoints

    ours, theirs = checkpoint_identity("aaaaaaaaaaaa", "lm"), checkpoint_identity("bbbbbbbbbbbb", "lm")
    root = tmp_path / "ck"
    save_checkpoint(root, 20, lambda f: _write(f, 20), ours)
    assert prepare_checkpoints(root, ours) == 20
    save_checkpoint(root, 40, lambda f: _write(f, 40), theirs)
    with pytest.raises(TrainingError, match=r"step-00000040: a checkpoint of another run or trial: config "
                                            r"'bbbbbbbbbbbb' \(this run: 'aaaaaaaaaaaa'\)"):
        prepare_checkpoints(root, ours)
    assert [s for s, _ in list_checkpoints(root)] == [20, 40]  # nothing moved or deleted
    with pytest.raises(TrainingError, match=r"trial 'lm' \(this run: 'layer1'\)"):
        prepare_checkpoints(root, checkpoint_identity("bbbbbbbbbbbb", "layer1"))


@pytest.mark.parametrize("damage", ["missing", "zeroed", "truncated", "foreign"])
def test_every_checkpoint_a_reader_takes_is_verified(tmp_path, damage):
    """--analysis-only read older checkpoints unchecked: a missing one was left out of every table, a zeroed
    one analysed, a truncated one failed inside Ray naming no file."""
    from actlake.storage.checkpoints import checkpoint_identity, verified_checkpoints

    me = checkpoint_identity("aaaaaaaaaaaa", "t")
    root = tmp_path / "ck"
    for step in (0, 10, 20):
        save_checkpoint(root, step, lambda f, s=step: _write(f, s), me)
    assert [s for s, _ in verified_checkpoints(root, [0, 10, 20], me)] == [0, 10, 20]
    middle = root / "step-00000010"
    state = middle / STATE_FILE
    if damage == "missing":
        import shutil

        shutil.rmtree(middle)
        expected = rf"{middle}: missing"
    elif damage == "zeroed":
        data = bytearray(state.read_bytes())
        data[200:1200] = bytes(1000)
        state.write_bytes(bytes(data))
        expected = rf"{state}: contents differ from its manifest"
    elif damage == "truncated":
        state.write_bytes(state.read_bytes()[:300])
        expected = rf"{state}: 300 bytes, its manifest says"
    else:
        save_checkpoint(root, 10, lambda f: _write(f, 10), checkpoint_identity("cccccccccccc", "t"))
        expected = rf"{middle}: a checkpoint of another run or trial"
    with pytest.raises(TrainingError, match=expected):
        verified_checkpoints(root, [0, 10, 20], me)


def test_a_training_job_on_a_run_directory_in_use_is_refused_naming_the_holder(sample_corpus, tmp_path, capsys):
    """Two train-lm jobs on one run directory both trained (no lock)."""
    import subprocess
    import sys

    path = _lm_yaml(tmp_path / "lm.yaml", sample_corpus, tmp_path / "runs")
    run = tmp_path / "runs" / "lm"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom actlake.storage.lock import run_lock\n"
                               f"with run_lock({str(run)!r}):\n    print('held', flush=True)\n    time.sleep(60)\n"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(["train-lm", str(path)]) == 2
        line = _one_error_line(capsys)
        assert line.startswith(f"actlake: error: {run} is in use by another job (pid {holder.pid} on ")
        assert not (run / "checkpoints").exists() and not (run / "data").exists()
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_file_that_is_a_link_or_a_fifo_is_refused_and_its_target_untouched(tmp_path):
    """RUN_DIR/.lock as a symbolic link was followed: its target was truncated and overwritten with the holder's
    JSON."""
    import os

    import pytest

    from actlake.errors import StorageError
    from actlake.storage.lock import run_lock

    victim = tmp_path / "precious.txt"
    victim.write_text("the user's file")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").symlink_to(victim)
    with pytest.raises(StorageError, match=r"\.lock is a symbolic link"):
        with run_lock(run):
            pass
    assert victim.read_text() == "the user's file"
    other = tmp_path / "run2"
    other.mkdir()
    os.mkfifo(other / ".lock")
    with pytest.raises(StorageError, match=r"\.lock is not a regular file"):
        with run_lock(other):
            pass
