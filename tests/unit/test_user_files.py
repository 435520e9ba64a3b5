"""Issue 50, principles 3 and 4: every file a user hands actlake is refused by name when it is not a regular file (a
FIFO nobody writes to hangs its reader for ever, a device such as /dev/zero never ends), and what reaches a terminal
has its control characters escaped while CSV and JSON keep the data as it is.

The commands run as child processes with a time limit (a hang fails the test instead of blocking it); code called
in this process reads FIFOs that :func:`fifo` feeds with an empty stream, so code that opens one gets an empty file
(and the test fails) instead of hanging. The run folders are built here (``publish_table``, no Ray): ``actlake sql``
draws any run's rows the same way, so a training run's table stands for the corpus ``source`` labels of an
extraction.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pytest

from actlake.errors import ConfigError, StorageError

ESC_LABEL = "a\x1b[2Jb"
"""A label that clears the screen when printed raw."""
LABELS = [ESC_LABEL, "c\x9b31md", "e\rf", "g\u202eh"]
"""An escape sequence, a C1 CSI (``\\x9b``: a CSI to terminals that take 8-bit controls), a carriage return, a
right-to-left override."""
RAW = (b"\x1b", b"\xc2\x9b", b"\r", "\u202e".encode())
"""Those characters' bytes as they would reach a terminal unescaped."""


def actlake(*args: str, shell: str | None = None) -> subprocess.CompletedProcess:
    """``actlake ARGS`` (or the bash line ``shell``, starting with ``actlake``) in a child process, its bytes
    captured; at most 60 s, so a command that hangs fails the test (its process group killed: ``actlake sql``'s
    query process too)."""
    prog = f"{sys.executable} -m actlake.jobs.cli"
    cmd = ["bash", "-c", prog + shell.removeprefix("actlake")] if shell else [*prog.split(), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _feed(path: str) -> None:
    """Open ``path`` for writing and close it at once: a reader that opened the FIFO reads an empty stream."""
    with contextlib.suppress(OSError):
        os.close(os.open(path, os.O_WRONLY))


@pytest.fixture
def fifo():
    """``fifo(path)``: a FIFO at ``path`` whose one writer closes as soon as a reader opens it; at the end the writer
    still waiting (the FIFO never opened, as it should be) is let go."""
    made = []

    def make(path) -> Path:
        os.mkfifo(path)
        t = threading.Thread(target=_feed, args=(str(path),), daemon=True)
        t.start()
        made.append((str(path), t))
        return Path(path)

    yield make
    for path, t in made:
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            t.join(5)
            os.close(fd)


def _corpus(tmp_path: Path) -> Path:
    f = tmp_path / "docs.jsonl"
    f.write_text(json.dumps({"text": "one small document", "meta": {"pile_set_name": "x"}}) + "\n")
    return f


def _job_yaml(tmp_path: Path, **extra) -> Path:
    """A job config that passes every check but those ``extra`` (top-level sections) bring."""
    cfg = {"name": "t", "corpus": {"paths": [str(_corpus(tmp_path))]}, "output": {"dir": str(tmp_path / "runs")}}
    cfg.update(extra)
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path


def _model_folder(folder: Path) -> Path:
    """A folder that passes for a Hugging Face model's until its files are read."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "bert"}))
    return folder


# --------------------------------------------------------------------------- the helper


def test_open_regular_names_what_each_kind_of_file_is(tmp_path):
    from actlake.fs import open_regular, read_regular

    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "folder").mkdir()
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock"))
    try:
        for path, kind in ((tmp_path / "pipe", "a FIFO"), ("/dev/null", "a character device"),
                           (tmp_path / "sock", "a socket"), (tmp_path / "folder", "a folder")):
            with pytest.raises(ConfigError) as e:
                open_regular(path, "--texts", ConfigError)
            assert str(e.value) == f"--texts: {path} is not a regular file ({kind})"
            again = pickle.loads(pickle.dumps(e.value))  # Ray moves errors between processes
            assert type(again) is ConfigError and str(again) == str(e.value)
    finally:
        sock.close()
    (tmp_path / "f").write_bytes(b"data")
    assert read_regular(tmp_path / "f") == b"data"
    with open_regular(tmp_path / "f") as f:
        assert f.read() == b"data"
    with pytest.raises(FileNotFoundError):
        read_regular(tmp_path / "missing")


# --------------------------------------------------------------------------- job configs


@pytest.mark.parametrize("command", ["run", "submit", "train-lm", "train-synthetic", "train-predictor",
                                     "corpus index"])
def test_a_config_that_is_a_fifo_or_a_device_is_refused_as_such(tmp_path, command):
    """Before: ``config file not found`` for a FIFO that is there (and for ``/dev/null``)."""
    os.mkfifo(tmp_path / "job.yaml")
    for path, kind in ((tmp_path / "job.yaml", "a FIFO"), ("/dev/null", "a character device")):
        r = actlake(*command.split(), str(path))
        assert r.returncode == 2
        assert r.stderr.decode().strip() == f"actlake: error: config file: {path} is not a regular file ({kind})"


def test_process_substitution_is_refused_as_a_fifo(tmp_path):
    r = actlake(shell="actlake run <(echo 'name: x')")
    assert r.returncode == 2
    assert r.stderr.decode().startswith("actlake: error: config file: /dev/fd/") and \
        r.stderr.decode().rstrip().endswith("is not a regular file (a FIFO)"), r.stderr


def test_texts_file_that_is_a_fifo_is_refused_before_the_model_loads(tmp_path):
    """Before: the command hung for ever in the read."""
    os.mkfifo(tmp_path / "texts")
    r = actlake("try-analysis", "dim_moments", "--texts", str(tmp_path / "texts"))
    assert r.returncode == 2
    assert r.stderr.decode().strip() == f"actlake: error: --texts: {tmp_path / 'texts'} is not a regular file (a FIFO)"


# --------------------------------------------------------------------------- custom analyses


def test_a_custom_analysis_file_or_module_that_is_a_fifo_is_refused_with_its_key(tmp_path):
    """Before: a FIFO ``.py`` was 'not a .py file or a package folder'; a FIFO module in a package folder passed, and
    the driver hung reading it to ship to the workers (``submit`` zips the whole folder: a FIFO data file too)."""
    from actlake.config import load_config

    os.mkfifo(tmp_path / "mine.py")
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    os.mkfifo(pkg / "sub" / "an.py")
    data = tmp_path / "data_pkg"
    data.mkdir()
    (data / "an.py").write_text("")
    os.mkfifo(data / "table.csv")
    for path, module, bad in ((tmp_path / "mine.py", "mine:X", tmp_path / "mine.py"),
                              (pkg, "pkg.sub.an:X", pkg / "sub" / "an.py"), (data, "data_pkg.an:X", data / "table.csv")):
        cfg = _job_yaml(tmp_path, analyses={"custom": [{"analysis": module, "path": str(path)}]})
        with pytest.raises(ConfigError, match=r"'analyses\.custom\.0\.path'.*: " + re.escape(str(bad)) +
                           r" is not a regular file \(a FIFO\)$"):
            load_config(cfg)


def test_the_code_shipped_to_the_workers_is_read_through_the_same_check(tmp_path, fifo):
    """A FIFO put into the package after the config was read is refused where the code is read for the workers
    (before: the driver hung there)."""
    from actlake.jobs.extract.run import custom_code

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    fifo(tmp_path / "pkg" / "an.py")
    cfg = SimpleNamespace(code_refs=[(("analyses", "custom", 0), "pkg.an:X", str(tmp_path / "pkg"))])
    with pytest.raises(ConfigError, match=r"^analyses\.custom: pkg\.an:X: .*an\.py is not a regular file \(a FIFO\)$"):
        custom_code(cfg)


def test_try_analysis_path_that_is_a_fifo_is_refused(tmp_path):
    """Before: ``cannot import 'mine:X' (ModuleNotFoundError ...)``, which does not say why."""
    os.mkfifo(tmp_path / "mine.py")
    r = actlake("try-analysis", "mine:X", "--path", str(tmp_path / "mine.py"), "--text", "hello")
    assert r.returncode == 2
    assert r.stderr.decode().strip() == f"actlake: error: --path: {tmp_path / 'mine.py'} is not a regular file (a FIFO)"


# --------------------------------------------------------------------------- model and tokenizer folders


@pytest.mark.parametrize("name", ["tokenizer.json", "model.safetensors", "config.json"])
def test_a_fifo_in_a_model_folder_is_refused_by_name_before_from_pretrained(tmp_path, name, fifo):
    """Before: a FIFO ``tokenizer.json`` was skipped by the run's identity and by transformers alike, which then built
    another tokenizer from ``vocab.txt`` without a word; a FIFO ``config.json`` was 'no config.json'."""
    from actlake.config import load_config, resolve_model_path

    folder = _model_folder(tmp_path / "model")
    (folder / name).unlink(missing_ok=True)
    fifo(folder / name)
    with pytest.raises(ConfigError) as e:
        resolve_model_path(str(folder))
    assert str(e.value) == f"model.name_or_path: {folder / name} is not a regular file (a FIFO)"
    with pytest.raises(ConfigError, match=r"is not a regular file \(a FIFO\)"):
        load_config(_job_yaml(tmp_path, model={"name_or_path": str(folder)}))


def test_the_runs_identity_refuses_a_model_file_that_is_no_regular_file(tmp_path, monkeypatch, fifo):
    """Before: ``model_files`` hashed the regular files and left the FIFO out, so the identity did not cover a file
    from_pretrained reads."""
    from actlake.jobs.extract.identity import model_files

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = _model_folder(tmp_path / "model")
    fifo(folder / "tokenizer.json")
    cfg = SimpleNamespace(model=SimpleNamespace(name_or_path=str(folder), revision=None))
    with pytest.raises(ConfigError, match=r"tokenizer\.json is not a regular file \(a FIFO\)"):
        model_files(cfg)


def test_a_sweep_checkpoints_weights_that_are_a_fifo_are_refused_not_skipped(tmp_path, fifo):
    """Before: a FIFO shard of the weights (in a subfolder too) was left out of the checkpoint's sha256."""
    from actlake.config import CheckpointConfig
    from actlake.jobs.extract.sweep import weights_digest

    folder = _model_folder(tmp_path / "ck")
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"weights")
    (folder / "part").mkdir()
    fifo(folder / "part" / "model-00002-of-00002.safetensors")
    with pytest.raises(StorageError, match=r"part/model-00002-of-00002\.safetensors is not a regular file \(a FIFO\)"):
        weights_digest(None, CheckpointConfig(path=str(folder), label="ck"))
    fifo(folder / "model.safetensors")
    with pytest.raises(ConfigError, match=r"^model\.checkpoints: ck: .*/model\.safetensors is not a regular file"):
        weights_digest(None, CheckpointConfig(path=str(folder), label="ck"))


def test_hashing_a_file_refuses_a_fifo(tmp_path, fifo):
    from actlake.hashing import file_sha256

    with pytest.raises(StorageError, match=r"is not a regular file \(a FIFO\)"):
        file_sha256(fifo(tmp_path / "w.safetensors"))


def test_train_lm_refuses_a_fifo_in_its_tokenizer_folder(tmp_path):
    """Before: the check passed and the tokenizer's fingerprint skipped the FIFO (its files are fingerprinted)."""
    from actlake.config import load_config
    from actlake.jobs.train.lm.config import LMConfig

    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text("{}")
    os.mkfifo(tok / "tokenizer.json")
    cfg = tmp_path / "lm.yaml"
    cfg.write_text(json.dumps({"corpus": {"paths": [str(_corpus(tmp_path))]}, "tokenizer": {"path": str(tok)},
                               "output": {"dir": str(tmp_path / "runs")}}))
    with pytest.raises(ConfigError, match=r"'tokenizer\.path': " + re.escape(str(tok / "tokenizer.json")) +
                       r" is not a regular file \(a FIFO\)$"):
        load_config(cfg, root=LMConfig)


def test_a_local_hf_dataset_folder_holding_a_fifo_is_refused(tmp_path):
    """Before: a ``corpus.hf_dataset`` folder passed unchecked, and the datasets library opened its files by name."""
    from actlake.config import load_config

    data = tmp_path / "ds" / "train"
    data.mkdir(parents=True)
    (tmp_path / "ds" / "dataset_info.json").write_text("{}")
    os.mkfifo(data / "data-00000-of-00001.arrow")
    cfg = _job_yaml(tmp_path)
    cfg.write_text(json.dumps({"name": "t", "corpus": {"format": "hf", "hf_dataset": str(tmp_path / "ds")},
                               "output": {"dir": str(tmp_path / "runs")}}))
    with pytest.raises(ConfigError, match=r"^corpus\.hf_dataset: .*data-00000-of-00001\.arrow is not a regular file "
                       r"\(a FIFO\)$"):
        load_config(cfg)


def test_a_corpus_file_opened_by_a_reader_is_checked_too(tmp_path, fifo):
    """The driver refuses a FIFO in ``corpus.paths``; a reader (a worker, the fingerprint) opens through the same
    check, so a FIFO put there after the driver's check is refused, not read."""
    from actlake.fs import open_input

    with pytest.raises(StorageError, match=r"docs\.jsonl is not a regular file \(a FIFO\)"):
        open_input(str(fifo(tmp_path / "docs.jsonl")))


# --------------------------------------------------------------------------- run folders handed to sql and report


def _run(root: Path, table: pa.Table | None = None) -> Path:
    """A training run folder holding ``table`` as ``lm_curve`` (no Ray)."""
    from actlake.storage.layout import RunLayout, write_run_json
    from actlake.storage.publish import publish_table

    root.mkdir()
    write_run_json(RunLayout(root), {"run_id": root.name, "kind": "train-lm"})
    publish_table(root, "lm_curve", None, table if table is not None else pa.table({"step": [1]}))
    return root


@pytest.mark.parametrize("record", ["run.json", "_complete/published.json", "sweep.json"])
def test_sql_refuses_a_run_folder_record_that_is_a_fifo(tmp_path, record):
    """Before: ``actlake sql`` hung for ever reading it (until its own 60 s limit, which a run record escaped)."""
    run = tmp_path / "r"
    if record == "sweep.json":  # a sweep's folder: its record first
        run.mkdir()
    else:
        _run(run)
        (run / record).unlink()
    os.mkfifo(run / record)
    r = actlake("sql", str(run), "SELECT 1 AS x")
    assert r.returncode == 2
    assert r.stderr.decode().strip() == f"actlake: error: {run / record} is not a regular file (a FIFO)"


def test_a_commit_record_that_is_a_fifo_is_not_accepted_and_not_read(tmp_path):
    """Before: ``actlake sql`` hung reading the group record; now it is left out like a damaged one."""
    run = tmp_path / "r"
    (run / "_complete").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"format": 2, "plan_hash": "p", "shards": [{"shard_id": 0}]}))
    os.mkfifo(run / "_complete" / "group-1-a.json")
    r = actlake("sql", str(run))
    assert r.returncode == 2 and "no committed tables" in r.stderr.decode(), r.stderr


def test_corpus_sample_refuses_a_fifo_record_in_its_folder(tmp_path):
    """Before: ``actlake corpus sample DIR`` hung reading ``DIR/SAMPLE.json``."""
    (tmp_path / "s").mkdir()
    os.mkfifo(tmp_path / "s" / "SAMPLE.json")
    r = actlake("corpus", "sample", str(tmp_path / "s"))
    assert r.returncode == 2 and "SAMPLE.json is not a regular file (a FIFO)" in r.stderr.decode(), r.stderr


# --------------------------------------------------------------------------- what reaches a terminal


def test_sql_table_escapes_control_characters_but_csv_and_json_keep_them(tmp_path):
    """Before: DuckDB's drawing escaped C0 controls in plain values only: a C1 CSI (``\\x9b``), a bidirectional
    override and every control character in a nested value's struct key reached the terminal raw."""
    run = _run(tmp_path / "r", pa.table({"step": list(range(len(LABELS))), "source": LABELS}))
    r = actlake("sql", str(run), "SELECT source, {'k': source} AS nested, [source] AS list FROM lm_curve ORDER BY step")
    assert r.returncode == 0, r.stderr
    assert not any(raw in r.stdout for raw in RAW), r.stdout
    text = r.stdout.decode()
    for shown in ("a\\x1b[2Jb", "c\\x9b31md", "e\\rf", "g\\u202eh"):
        assert shown in text
    r = actlake("sql", str(run), "SELECT source FROM lm_curve ORDER BY step", "--format", "csv")
    assert r.stdout == b'"source"\n' + b"".join(f'"{v}"\n'.encode() for v in LABELS)  # data, kept byte for byte
    r = actlake("sql", str(run), "SELECT source FROM lm_curve ORDER BY step", "--format", "json")
    assert [json.loads(line)["source"] for line in r.stdout.decode().splitlines()] == LABELS


def test_sql_error_line_escapes_a_value_it_quotes(tmp_path):
    """Before: DuckDB's conversion error quoted the label with its escape sequence raw on standard error."""
    run = _run(tmp_path / "r", pa.table({"step": [0], "source": [ESC_LABEL]}))
    r = actlake("sql", str(run), "SELECT * FROM lm_curve WHERE source = 1")
    assert r.returncode == 2
    assert b"\x1b" not in r.stderr and "'a\\x1b[2Jb'" in r.stderr.decode(), r.stderr


def test_an_error_line_escapes_a_file_name(tmp_path):
    """Before: ``config file not found: …/x<ESC>[2J.yaml`` with the escape sequence raw."""
    r = actlake("run", str(tmp_path / "x\x1b[2J\r.yaml"))
    assert r.returncode == 2
    assert r.stderr.decode().strip() == f"actlake: error: config file not found: {tmp_path}/x\\x1b[2J\\r.yaml"


def test_the_jobs_tables_and_log_lines_escape_control_characters(capsys):
    """``actlake run``'s example query (by source) and try-analysis's tables are drawn like ``actlake sql``'s; the
    console's log lines escape the labels and names they echo (a traceback keeps its lines)."""
    from actlake.jobs.cli import PrintableFormatter, _show

    _show(pa.table({"source": LABELS}))
    out = capsys.readouterr().out
    assert not any(raw.decode() in out for raw in RAW) and "c\\x9b31md" in out
    record = logging.LogRecord("actlake.sweep", logging.WARNING, __file__, 1, "checkpoint %s has identical weights",
                               (ESC_LABEL + "\nforged line",), None)
    line = PrintableFormatter("%(name)s: %(message)s").format(record)
    assert line == "actlake.sweep: checkpoint a\\x1b[2Jb\\nforged line has identical weights"


def test_printable_keeps_the_lines_of_a_message_of_several():
    from actlake.errors import printable, printable_lines

    assert printable("x\ty\u2028z\x7f") == "x\\ty\\u2028z\\x7f"
    assert printable("naïve — ok") == "naïve — ok"
    assert printable_lines("2 shard(s) failed:\n  shard 0: \x1b[31m") == "2 shard(s) failed:\n  shard 0: \\x1b[31m"
