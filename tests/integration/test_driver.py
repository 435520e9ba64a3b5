"""The job's driver (issue 31, item 2): Ctrl-C is exit 130 and one line, no traceback; a second job on the
same run directory is refused, naming the first."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _start_job(cfg: Path, cwd: Path, env: dict) -> tuple[subprocess.Popen, list[str]]:
    """``actlake run cfg`` in a subprocess, returned once it dispatches shards (its stderr lines so far)."""
    root = Path(__file__).resolve().parents[2]
    # as a terminal starts it: Ctrl-C's signal handled by default, also when this suite runs in the background
    # of a non-interactive shell (which ignores SIGINT in its background jobs, and an ignored signal is inherited)
    start = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
             "os.execv(sys.executable, [sys.executable, '-m', 'actlake.jobs.cli', 'run', sys.argv[1]])")
    proc = subprocess.Popen([sys.executable, "-c", start, str(cfg)], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(env, PYTHONPATH=str(root)))
    seen = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # wait until shards are on their way
        line = proc.stderr.readline()
        seen.append(line)
        if "dispatching" in line or not line:
            break
    assert any("dispatching" in s for s in seen), "".join(seen)[-3000:]
    return proc, seen


def _config(tmp_path: Path, minilm_path, sample_corpus) -> Path:
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"model:\n  name_or_path: {minilm_path}\ncorpus:\n  paths: ['{sample_corpus}/*.jsonl.zst']\n"
                   f"sharding:\n  docs_per_shard: 2\noutput:\n  dir: {tmp_path}/runs\n  run_id: r\n  report: false\n"
                   "resources:\n  num_workers: 1\n  cpus_per_worker: 1\n")
    return cfg


def test_ctrl_c_stops_a_job_with_exit_130_and_one_line(minilm_path, sample_corpus, tmp_path, own_ray_env):
    proc, seen = _start_job(_config(tmp_path, minilm_path, sample_corpus), tmp_path, own_ray_env)
    time.sleep(3)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (out + "".join(seen) + err)[-3000:]
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("actlake: interrupted;")


def test_a_second_job_on_the_same_run_directory_is_refused_naming_the_first(minilm_path, sample_corpus, tmp_path,
                                                                           own_ray_env, capsys):
    """Both did all the work before (no lock)."""
    from actlake.jobs.cli import main

    cfg = _config(tmp_path, minilm_path, sample_corpus)
    proc, _ = _start_job(cfg, tmp_path, own_ray_env)
    try:
        assert main(["run", str(cfg)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith(f"actlake: error: {tmp_path}/runs/r is in use by another job (pid {proc.pid} on ")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=120)
    assert proc.returncode == 130


def test_the_command_a_job_prints_runs_as_printed_in_a_new_shell(minilm_path, sample_corpus, tmp_path, own_ray_env):
    """Issue 33: the quick start printed ``actlake sql …``, which a new shell without the virtual environment
    on its PATH cannot find. The job runs as ``.venv/bin/actlake`` does, outside the venv's PATH; the printed
    example is then pasted into ``bash`` with a bare PATH."""
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"model: {{name_or_path: {minilm_path}}}\ncorpus: {{paths: ['{sample_corpus}/*.jsonl.zst'], max_docs: 6}}\n"
                   f"sharding: {{docs_per_shard: 3}}\noutput: {{dir: '{tmp_path}/my runs', run_id: r, report: false}}\n"
                   "resources: {num_workers: 1, cpus_per_worker: 1}\n")
    actlake = Path(sys.executable).with_name("actlake")
    bare = {k: v for k, v in own_ray_env.items() if k != "PATH"} | {"PATH": "/usr/bin:/bin"}
    done = subprocess.run([str(actlake), "run", str(cfg)], cwd=tmp_path, env=bare, text=True, capture_output=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("example: ")]
    command = line.removeprefix("example: ")
    assert command.startswith(str(actlake)) and "'" in command  # the absolute path; the folder with a space quoted
    pasted = subprocess.run(["bash", "-c", command], cwd=tmp_path / "my runs", env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
                            text=True, capture_output=True, timeout=120)
    assert pasted.returncode == 0, pasted.stderr
    assert "mean_norm" in pasted.stdout and pasted.stdout.count("│") > 10
