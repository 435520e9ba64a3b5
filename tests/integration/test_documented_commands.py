"""Every command the README and the docs tell a reader to run, run as printed, from the repository's folder,
in a shell whose PATH does not hold the virtual environment (a reader's new terminal): the quick start, the
command it prints, the five-minute tour and its checkpoint sweep, and the S3 walkthrough against a local S3 server
(``tests/documented.py`` finds the blocks by their ``<!-- command: ID -->``)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess

import pytest
import yaml

from actlake.corpus.sample import write_sample
from actlake.storage.sql import query
from tests.documented import BIN, ROOT, command
from tests.documented import new_shell as _bash
from tests.documented import new_shell_env as _env

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def quickstart():
    """``bash scripts/quickstart.sh`` as the README prints it (in CI: a fresh clone, so a fresh corpus and run)."""
    return _bash(command("quickstart"), timeout=1800)


RAY_NOISE = ("core_worker.cc", "Token authentication", "Started a local Ray instance", "Loading weights",
             "TrainingReport(", "Writing model shards", "PreemptionWatcher", "Moving model to device",
             "Requesting resources", "Setting up process group", "worker group")
"""What Ray and transformers printed on every run's console before issue 53 (a user's console shows actlake's
progress and real problems only)."""


def quiet(done) -> list[str]:
    """The lines of a command's console that carry any of :data:`RAY_NOISE`."""
    return [ln for ln in (done.stdout + done.stderr).splitlines() if any(m in ln for m in RAY_NOISE)]


def test_the_quick_start_prints_a_command_that_runs_in_a_new_shell(quickstart):
    assert "actlake.progress: shard 00000 done" in quickstart.stderr  # progress lines from the workers
    assert quiet(quickstart) == []
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
    by_norm = _bash(ACTIVATE + command("norms-by-source")).stdout  # docs/querying.md: the join through documents
    assert all(label in by_norm for label in ("PythonSource", "Licenses", "mean_norm")), by_norm
    _norms_by_source_equal_pandas(command("norms-by-source"))
    massive = _bash(ACTIVATE + command("tour-massive")).stdout
    assert "share_of_norm2" in massive and sum(ln.startswith("│") for ln in massive.splitlines()) == 2 + 7, massive
    intervened = _bash(ACTIVATE + command("tour-intervene"), timeout=1800)  # the causal question: its answer
    assert quiet(intervened) == [] and sum(ln.startswith("│ dim") for ln in intervened.stdout.splitlines()) == 2 * 5
    checked = subprocess.run([str(BIN / "python"), "scripts/findings.py", "--check"], cwd=ROOT, env=_env(),
                             capture_output=True, text=True, timeout=300)  # the README's answer is this run's
    assert checked.returncode == 0 and checked.stdout.strip() == "current", checked.stdout + checked.stderr
    by_pass = _bash(ACTIVATE + command("interventions-by-pass")).stdout  # docs/interventions.md
    assert all(f"│ {p}" in by_pass for p in ("none", "dim99_on_cls", "dim69_on_cls")), by_pass
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


def test_the_sae_page_exports_the_sample_and_saelens_trains_on_it(quickstart):
    """docs/sae.md as printed: a run with an activation store, both exports, the token reader, SAELens training from
    the cache alone (after the quick start: its sample corpus)."""
    for folder in ("sae-sample-tokens", "sae-sample-saelens"):  # a reader's earlier try of the page
        shutil.rmtree(ROOT / "runs" / folder, ignore_errors=True)
    done = _bash(ACTIVATE + command("sae-export"), timeout=1800)
    assert quiet(done) == [] and "export:  runs/sae-sample-saelens" in done.stdout, done.stdout
    for code, mark in ((command("sae-tokens-python"), "tokens of width 384"),
                       (command("sae-saelens-python"), "trained on 12800")):
        shown = subprocess.run([str(BIN / "python"), "-c", code], cwd=ROOT, env=_env(), capture_output=True,
                               text=True, timeout=900)
        assert shown.returncode == 0 and mark in shown.stdout, shown.stdout + shown.stderr[-3000:]


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


def test_the_tour_s_sweep_and_runs_side_by_side(quickstart, tmp_path):
    """The tour's last block as printed, in a folder of its own (a reader's runs/lm-quick stays as it is), with the
    train-lm config scaled down to a tiny LM (the same steps, so the same snapshots the sweep config names) and a
    48-document sample for it and the sweep; the side-by-side query reads the quick start's run (runs/quickstart,
    linked)."""
    write_sample(tmp_path / "data" / "sample", n_docs=48, n_files=2)
    (tmp_path / "configs").mkdir()
    shutil.copy(ROOT / "configs" / "lm_quick_sweep.yaml", tmp_path / "configs")
    lm = yaml.safe_load((ROOT / "configs" / "lm_quick.yaml").read_text())
    lm["tokenizer"]["vocab_size"] = 300
    lm["model"] = {"hidden_size": 16, "num_layers": 2, "num_heads": 2, "intermediate_size": 32}
    lm["training"].update(batch_size=2, seq_len=16, warmup_steps=5, eval_every=400, checkpoint_every=400)
    lm["resources"]["cpus_per_worker"] = 1
    (tmp_path / "lm_tiny.yaml").write_text(yaml.safe_dump(lm))
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "quickstart").symlink_to(ROOT / "runs" / "quickstart")
    done = _bash(f"source {ROOT}/.venv/bin/activate\n" + command("tour-sweep").replace("configs/lm_quick.yaml", "lm_tiny.yaml"),
                 cwd=tmp_path)
    out = done.stdout
    assert quiet(done) == [] and re.search(r"lm step 800/800: train loss", done.stderr), done.stderr
    assert "train-lm: 7 snapshots" in out and "(every one's weights differ)" in out
    (table,) = [t for t in out.split("┌") if re.search(r"│\s*layer\s*│\s*step\s*│\s*mass_on_first", t)]
    sweep = {(int(a), int(b)) for a, b in re.findall(r"^│\s*(\d+)\s*│\s*(\d+)\s*│\s*[\d.]+\s*│$", table, re.M)}
    assert sweep == {(layer, step) for layer in (0, 1) for step in (0, 2, 8, 27, 85, 262, 800)}, out
    side = re.findall(r"^│\s*(quickstart|step-800)\s*│\s*(\d+)\s*│\s*([\d.]+)\s*│$", out, re.M)
    assert sorted((run, int(layer)) for run, layer, _ in side) == sorted(
        [("quickstart", layer) for layer in range(6)] + [("step-800", layer) for layer in range(2)]), out
    own = query(tmp_path / "runs" / "quickstart", "SELECT layer, round(avg(mean_mass), 3) AS m FROM attention_mass_by_key "
                "WHERE key_category = 'bos' GROUP BY ALL").to_pylist()
    assert {(int(la), float(m)) for run, la, m in side if run == "quickstart"} == {(r["layer"], r["m"]) for r in own}
    tokens = query(tmp_path / "runs" / "lm-quick-sweep" / "checkpoints" / "step-800",
                   "SELECT count(*) FILTER (WHERE role = 'bos') AS bos, count(*) FILTER (WHERE role = 'bos' AND position = 0) "
                   "AS first, count(DISTINCT (doc_id, window_index)) AS windows FROM tokens").to_pylist()[0]
    assert tokens["bos"] == tokens["first"] == tokens["windows"] > 0  # prepend_bos: the BOS first in every window


def _norms_by_source_equal_pandas(cmd: str) -> None:
    """The documented query's numbers against the same join and means in pandas, over the run's tables."""
    import re

    import numpy as np

    from actlake import open_run

    sql = re.search(r'"(SELECT.*)"', cmd, re.S).group(1)
    con = open_run(str(ROOT / "runs" / "quickstart"))
    got = con.sql(sql.replace("round(avg(r.norm), 2)", "avg(r.norm)")).df()
    norms = con.sql("SELECT doc_id, layer, norm FROM residual_norms WHERE layer IN (0, 6)").df()
    docs = con.sql("SELECT doc_id, source FROM documents").df()
    con.close()
    want = norms.merge(docs, on="doc_id").groupby(["source", "layer"]).norm.mean()
    assert len(got) == len(want) > 2
    np.testing.assert_allclose(got.set_index(["source", "layer"]).mean_norm.loc[want.index], want, rtol=1e-9)
