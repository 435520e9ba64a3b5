"""scripts/layout_counts.py and scripts/shard_crossings.py (issue 49's closing note): they run, and what they count
agrees with a count made here another way."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration]
ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> str:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def test_layout_counts_lines_as_a_plain_count_does():
    out = _run("scripts/layout_counts.py", "attention_peak")
    row = next(line.split() for line in out.splitlines() if line.startswith("jobs/extract "))
    files = sorted(p for p in (ROOT / "jobs" / "extract").rglob("*.py") if "__pycache__" not in p.parts)
    assert int(row[1]) == len(files)
    assert int(row[2]) == sum(len(p.read_text().splitlines()) for p in files)
    assert int(row[3]) + int(row[4]) + int(row[5]) + int(row[6]) == int(row[2])  # code, docstring, comment, blank
    assert "analysis/attention_peak.py" in out and "analysis/registry.py" in out


def test_shard_crossings_traces_a_real_shard(sample_corpus):
    out = _run("scripts/shard_crossings.py", "--edges", "--corpus", str(sample_corpus / "*.jsonl.zst"))
    total = next(line.split() for line in out.splitlines() if line.startswith("all "))
    edges, calls = int(total[1]), int(total[2])
    assert 0 < edges <= calls
    listed = [line for line in out.splitlines() if line.startswith("  ") and " -> " in line]
    assert len(listed) == edges and sum(int(line.rsplit(": ", 1)[1]) for line in listed) == calls
    assert any(line.strip().startswith("actlake.jobs.extract.driver.") for line in listed)  # the worker's shard
