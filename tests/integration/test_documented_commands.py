"""Every command the README and the docs tell a reader to run, run as printed, from the repository's folder,
in a shell whose PATH does not hold the virtual environment (a reader's new terminal): the quick start, the
command it prints, the five-minute tour, and the S3 walkthrough against a local S3 server
(``tests/documented.py`` finds the blocks by their ``<!-- command: ID -->``)."""

from __future__ import annotations

import shlex
import subprocess

import pytest

from tests.documented import BIN, ROOT, command
from tests.documented import new_shell as _bash
from tests.documented import new_shell_env as _env

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def quickstart():
    """``bash scripts/quickstart.sh`` as the README prints it (in CI: a fresh clone, so a fresh corpus and run)."""
    return _bash(command("quickstart"), timeout=1800)


def test_the_quick_start_prints_a_command_that_runs_in_a_new_shell(quickstart):
    assert "actlake.progress: shard 00000 done" in quickstart.stderr  # progress lines from the workers
    (line,) = [ln for ln in quickstart.stdout.splitlines() if ln.startswith("example: ")]
    printed = line.removeprefix("example: ")
    assert printed.startswith(str(BIN / "actlake")), printed  # the venv is not on this shell's PATH
    shown = _bash(printed).stdout
    assert "mean_norm" in shown and shown.count("│") > 10


def test_the_docs_figures_are_what_the_quick_start_gives(quickstart):
    """docs/findings.md's headline figures are written by scripts/findings.py from the runs; on the shipped
    sample every machine's quick start gives them."""
    assert "tokens:  150,768 in 1,261 windows of 400 documents" in quickstart.stdout
    checked = subprocess.run([str(BIN / "python"), "scripts/findings.py", "--check"], cwd=ROOT, env=_env(),
                             capture_output=True, text=True, timeout=300)
    assert checked.returncode == 0 and checked.stdout.strip() == "current", checked.stdout + checked.stderr


def test_activating_the_environment_then_querying(quickstart):
    out = _bash(command("activate-and-query")).stdout
    assert "mean_norm" in out and " 6 " in out  # MiniLM: hidden states 0 to 6


ACTIVATE = "source .venv/bin/activate\n"
"""The tour's commands run "with the environment active", as it says."""


def test_the_five_minute_tour(quickstart):
    again = _bash(ACTIVATE + command("tour-run")).stdout
    assert "(0 of 8 shards ran)" in again
    outliers = _bash(ACTIVATE + command("tour-sql")).stdout
    assert "robust_z" not in outliers and " z " in outliers
    by_source = _bash(ACTIVATE + command("tour-by-source")).stdout
    assert all(label in by_source for label in ("PythonSource", "Licenses", "│ *")), by_source
    massive = _bash(ACTIVATE + command("tour-massive")).stdout
    assert "share_of_norm2" in massive and sum(ln.startswith("│") for ln in massive.splitlines()) == 2 + 7, massive
    for code in (command("tour-python"), command("querying-python")):
        shown = subprocess.run([str(BIN / "python"), "-c", code], cwd=ROOT, env=_env(), capture_output=True,
                               text=True, timeout=300)
        assert shown.returncode == 0 and "key_category" in shown.stdout, shown.stderr
    page = ROOT / "runs" / "quickstart" / "report" / "report.html"
    page.unlink()
    _bash(ACTIVATE + command("tour-report"))
    assert page.is_file()
    tried = _bash(ACTIVATE + command("tour-try")).stdout
    assert "attention_entropy: " in tried and "attention_entropy_mean: " in tried


def test_the_s3_walkthrough_against_a_local_server(quickstart):
    """docs/cluster.md's walkthrough: moto's server, one file of the sample corpus uploaded, the default job
    on its first 50 documents on s3://."""
    out = _bash("trap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n" + command("s3-walkthrough"), timeout=1800).stdout
    counts = "SELECT count(*) AS tokens, count(DISTINCT doc_id) AS documents FROM tokens"
    of_file_00 = counts + (" WHERE doc_id IN (SELECT doc_id FROM documents WHERE file LIKE '%/00.jsonl.zst' "
                           "AND record < 50)")  # corpus.max_docs: 50
    local = _bash(f"{BIN / 'actlake'} sql runs/quickstart {shlex.quote(of_file_00)}").stdout
    assert local.strip().splitlines()[-2] in out  # the object store's run of file 00 = the local run's rows of it
    assert out.strip().splitlines()[-2] not in _bash(f"{BIN / 'actlake'} sql runs/quickstart {shlex.quote(counts)}").stdout
    (ROOT / "s3job.yaml").unlink()
