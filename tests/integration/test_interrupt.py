"""Ctrl-C during a job: exit 130 and one line, no traceback; what was committed stays (issue 31, item 2)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_ctrl_c_stops_a_job_with_exit_130_and_one_line(minilm_path, sample_corpus, tmp_path, own_ray_env):
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"model:\n  name_or_path: {minilm_path}\ncorpus:\n  paths: ['{sample_corpus}/*.jsonl.zst']\n"
                   f"sharding:\n  docs_per_shard: 2\noutput:\n  dir: {tmp_path}/runs\n  report: false\n"
                   "resources:\n  num_workers: 1\n  cpus_per_worker: 1\n")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-m", "actlake.cli", "run", str(cfg)], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(own_ray_env, PYTHONPATH=str(root)))
    seen = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # wait until shards are on their way
        line = proc.stderr.readline()
        seen.append(line)
        if "dispatching" in line or not line:
            break
    assert any("dispatching" in s for s in seen), "".join(seen)[-3000:]
    time.sleep(3)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (out + "".join(seen) + err)[-3000:]
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("actlake: interrupted;")
