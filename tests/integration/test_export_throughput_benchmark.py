"""benchmarks/export_throughput.py in CI size (issue 52, step 4): a real job with an activation store, the plain
forward pass over its windows and both exports, side by side; the sizes it reports are the files' own. No timing is
asserted (timings belong in benchmarks, not tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def test_the_export_benchmark_runs_and_its_sizes_are_the_files(sample_corpus, tmp_path):
    out = tmp_path / "m.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "export_throughput.py"), "--max-docs", "6",
                           "--corpus", str(sample_corpus / "*.jsonl.zst"), "--out", str(tmp_path / "runs"),
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    m = json.loads(out.read_text())
    assert "export --format tokens" in done.stdout and "TB per layer" in done.stdout
    assert m["exported_rows"] == m["tokens"] > 0  # every token of every window, none dropped (drop_roles none)
    shards = sum(p.stat().st_size for p in (tmp_path / "runs" / "tokens").iterdir())
    assert m["tokens_bytes_per_token"] == pytest.approx(shards / m["tokens"])
    assert 4 * m["d_model"] < m["tokens_bytes_per_token"] < 4 * m["d_model"] + 64  # float32 rows, their index
