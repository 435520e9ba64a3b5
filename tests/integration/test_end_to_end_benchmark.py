"""benchmarks/end_to_end.py in CI size (issue 54): it runs a real job and the plain forward pass over the job's
own windows, and its breakdown accounts for the job's time without counting anything twice. No timing is
asserted (timings belong in benchmarks, not tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from actlake.storage.sql import query

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def test_the_end_to_end_benchmark_runs_and_its_breakdown_adds_up(sample_corpus, tmp_path):
    cfg = yaml.safe_load((ROOT / "actlake" / "default.yaml").read_text())
    cfg["corpus"]["paths"] = [str(sample_corpus / "*.jsonl.zst")]
    cfg["sharding"]["docs_per_shard"] = 4
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "rounds.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "end_to_end.py"), str(tmp_path / "job.yaml"),
                           "--max-docs", "8", "--repeats", "1", "--out", str(tmp_path / "runs"), "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "x plain" in done.stdout and "bytes/token" in done.stdout
    (r,) = json.loads(out.read_text())
    (run,) = [p.parent for p in (tmp_path / "runs").glob("*/summary.json")]
    assert r["tokens"] == query(run, "SELECT count(*) AS n FROM tokens").to_pylist()[0]["n"] > 0
    assert r["batches"] == r["job_batches"] > 0  # the in-process passes run the job's own batches
    s = r["seconds"]
    assert all(v >= 0 for v in s.values()), s
    inside = s["read"] + s["compute"] + s["write"] + s["merge"] + s["commit"]
    assert 0 < s["worker_start"] and 0 < s["model_load"], s
    assert s["ray_start"] + s["worker_start"] + s["model_load"] + inside <= s["dispatch"] + 0.05, s  # nothing twice
    assert s["before_dispatch"] + s["dispatch"] + s["reduce"] + s["ray_stop"] <= r["job_s"] + 0.05, (s, r["job_s"])
    assert r["omp_wait_policy"] == "PASSIVE", r  # tests/conftest.py sets it for the suite: the driver's setting wins
    sizes = {t: sum(p.stat().st_size for p in (run / "tables" / t).rglob("*.parquet")) for t in ("tokens", "residual_norms")}
    assert r["bytes_per_token"] == pytest.approx({t: b / r["tokens"] for t, b in sizes.items()})
