"""``actlake export RUN --format tokens`` (issue 52, step 2): every stored token once, in a seeded global order, in
fixed-size shards with their index and the mean norm, out of core; ``actlake.activations.iterate`` streams it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from actlake.activations import iterate, read_shard
from actlake.errors import ConfigError
from actlake.jobs.cli import main
from actlake.jobs.export import export_tokens
from actlake.jobs.extract.run import run_job
from actlake.storage.sql import open_run
from tests.conftest import job_config

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("kept_workers")]


STORE = {"analyses.contributions": False, "analyses.geometry": False, "analyses.attention_by_distance": False,
         "corpus.max_docs": 12, "activations.layers": [1, -1], "activations.dtype": "float16",
         "tokenization.max_length": 200, "tokenization.prepend_bos": True}
"""The store's job: long enough windows that some documents end inside one; each window begins with BOS (dropped
by default)."""


@pytest.fixture(scope="module")
def store_job(tiny_models, sample_corpus, tmp_path_factory, ray_local):
    cfg = job_config(tiny_models["gpt_neox"], sample_corpus, tmp_path_factory.mktemp("store"), **STORE)
    return cfg, run_job(cfg).run_dir


@pytest.fixture(scope="module")
def store(store_job):
    return store_job[1]


def _stored(run_dir, layer, where="true"):
    rows = open_run(run_dir).sql(f"SELECT doc_id, window_index, position, token_id, h FROM activations "
                                 f"WHERE layer = {layer} AND {where}").fetchall()
    return {(d, w, p): (t, np.asarray(h, np.float32)) for d, w, p, t, h in rows}


def test_every_token_once_shuffled_by_the_seed_with_its_index_and_mean_norm(store, tmp_path):
    want = _stored(store, 1, "role <> 'bos'")  # the default leaves BOS out
    m = export_tokens(store, 1, tmp_path / "a", shard_rows=100, seed=7, memory_mb=0.2)
    assert m["rows"] == len(want) > 300 and [s["rows"] for s in m["shards"]][:-1] == [100] * (len(m["shards"]) - 1)
    assert json.loads((tmp_path / "a" / "manifest.json").read_text()) == m
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == sorted(["manifest.json"] + [s["file"] for s in m["shards"]])
    keys, vectors = [], []
    for entry in m["shards"]:
        h, index = read_shard(tmp_path / "a", entry, with_index=True)
        for i, key in enumerate(zip(index["doc_id"], index["window_index"], index["position"])):
            key = tuple(int(k) for k in key)
            keys.append(key)
            assert int(index["token_id"][i]) == want[key][0]
            np.testing.assert_array_equal(h[i].numpy(), want[key][1])  # float16 stored, read back as float32 exactly
        vectors.append(h)
    assert len(keys) == len(set(keys)) == len(want)  # every token exactly once
    assert keys != sorted(keys)  # shuffled: not the store's order
    norms = torch.cat(vectors).double().norm(dim=1)
    assert m["mean_norm"] == pytest.approx(float(norms.mean()), rel=1e-12)
    again = export_tokens(store, 1, tmp_path / "b", shard_rows=100, seed=7, memory_mb=0.2, workers=2)  # Ray tasks
    other = export_tokens(store, 1, tmp_path / "c", shard_rows=100, seed=8, memory_mb=0.2)
    first = lambda folder, mm: read_shard(folder, mm["shards"][0], with_index=True)[1]["doc_id"]  # noqa: E731
    assert not (first(tmp_path / "c", other) == first(tmp_path / "a", m)).all()  # another seed, another order
    for entry in m["shards"]:  # the seed fixes the bytes, whichever processes ran pass 1
        assert (tmp_path / "a" / entry["file"]).read_bytes() == (tmp_path / "b" / entry["file"]).read_bytes()
    assert again == m | {"shards": again["shards"]} and again["shards"] == m["shards"]


def test_the_reader_streams_every_row_in_batches_and_the_bf16_npy_choices(store, tmp_path):
    m = export_tokens(store, 2, tmp_path / "bf", shard_rows=64, dtype="bfloat16", seed=1)
    batches = list(iterate(tmp_path / "bf", batch_size=50))
    assert [len(b) for b in batches[:-1]] == [50] * (len(batches) - 1) and sum(map(len, batches)) == m["rows"]
    whole = torch.cat([read_shard(tmp_path / "bf", s) for s in m["shards"]])
    assert torch.equal(torch.cat(batches), whole) and whole.dtype == torch.float32
    loader = torch.utils.data.DataLoader(iterate(tmp_path / "bf", batch_size=32), batch_size=None, num_workers=2)
    assert sum(len(b) for b in loader) == m["rows"]  # two workers split the shards, nothing twice
    npy = export_tokens(store, 2, tmp_path / "npy", shard_rows=64, file_format="npy", seed=1)
    got = torch.cat([read_shard(tmp_path / "npy", s) for s in npy["shards"]])
    assert (got.bfloat16().float() == whole).all()  # the same rows in the same order, bf16 rounding apart


def test_bad_requests_are_one_line_and_nothing_is_overwritten(store, tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("mine")
    for argv, message in (
            (["--layer", "1", "-o", str(tmp_path / "taken")], "exists; the export writes a new folder"),
            (["--layer", "5", "-o", str(tmp_path / "x")], "no rows for hidden state 5 (it holds [1, 2])"),
            (["--layer", "1", "-o", str(tmp_path / "x"), "--shard-rows", "0"], "--shard-rows: must be at least 1"),
            (["--layer", "1", "-o", str(tmp_path / "x"), "--dtype", "bfloat16", "--file-format", "npy"],
             "needs --file-format safetensors"),
            (["--layer", "1", "-o", str(tmp_path / "x"), "--context-size", "8"],
             "export --format tokens: --context-size belong(s) to another --format")):
        assert main(["export", store, "--format", "tokens", *argv]) == 2
        assert message in capsys.readouterr().err
    assert main(["export", store, "--format", "saelens", "--layer", "1", "-o", str(tmp_path / "x"), "--seed", "3"]) == 2
    assert "export --format saelens: --seed belong(s) to another --format" in capsys.readouterr().err
    assert (tmp_path / "taken" / "mine.txt").read_text() == "mine" and not (tmp_path / "x").exists()
    assert not list(tmp_path.glob("*.partial*"))
    with pytest.raises(ConfigError, match="not a token export"):
        iterate(tmp_path / "taken", 8)
    assert main(["export", store, "--format", "tokens", "--layer", "1", "-o", str(tmp_path / "ok")]) == 0
    assert "export:  " in capsys.readouterr().out
    for bad in ("../ok/shard-00000.safetensors", "/etc/passwd", ""):  # a manifest naming a file outside its folder
        with pytest.raises(ConfigError, match="is not a file name of the export's folder"):
            read_shard(tmp_path / "ok", {"file": bad, "rows": 1})


def test_the_saelens_cache_passes_saelens_own_check_and_holds_every_full_window(store, tmp_path, capsys):
    """SAELens's ``ActivationsStore.load_cached_activation_dataset`` (its own code, on an object carrying the
    settings it reads) accepts the folder for its hook, context size and width; every row is one full window of the
    store, in order, with its token ids; shorter windows are counted as left out."""
    from types import SimpleNamespace

    from sae_lens.training.activations_store import ActivationsStore

    from actlake.jobs.export import export_saelens

    want = _stored(store, 1)
    lengths = {}
    for d, w, _ in want:
        lengths[d, w] = lengths.get((d, w), 0) + 1
    T = max(lengths.values())
    full = sorted(k for k, n in lengths.items() if n == T)
    m = export_saelens(store, 1, tmp_path / "cache")
    files = m.pop("files")
    assert m == {"rows": len(full), "context_size": T, "d_model": 32, "hook_name": "blocks.1.hook_resid_pre",
                 "left_out_shorter": len(lengths) - len(full), "left_out_longer": 0}
    assert files == len(list((tmp_path / "cache").glob("data-*.arrow"))) > 1  # one Arrow file per store file
    assert len(full) >= 2 and m["left_out_shorter"] > 0
    settings = SimpleNamespace(cached_activations_path=str(tmp_path / "cache"), hook_name="blocks.1.hook_resid_pre",
                               context_size=T, d_in=32, device="cpu", dtype=torch.float32)
    ds = ActivationsStore.load_cached_activation_dataset(settings)
    assert len(ds) == len(full)
    for row, (doc, win) in zip(ds, full):
        assert row["token_ids"].tolist() == [want[doc, win, p][0] for p in range(T)]
        np.testing.assert_array_equal(row["blocks.1.hook_resid_pre"].numpy(),
                                      np.stack([want[doc, win, p][1] for p in range(T)]))
    settings.context_size = T + 1
    with pytest.raises(ValueError, match="does not match context_size"):
        ActivationsStore.load_cached_activation_dataset(settings)
    with pytest.raises(ConfigError, match="no stored window has exactly"):
        export_saelens(store, 1, tmp_path / "none", context_size=T + 5)
    with pytest.raises(ConfigError, match="--context-size: must be at least 1, got 0"):
        export_saelens(store, 1, tmp_path / "none", context_size=0)
    shorter = max(n for n in lengths.values() if n < T)  # a smaller context: the longer windows are named
    small = export_saelens(store, 1, tmp_path / "small", context_size=shorter)
    assert small["left_out_longer"] == sum(n > shorter for n in lengths.values()) > 0
    assert not (tmp_path / "none").exists() and not list(tmp_path.glob("*.partial*"))
    import datasets

    by_tasks = export_saelens(store, 1, tmp_path / "tasks", workers=2)  # Ray tasks, two at a time: the same rows
    assert by_tasks["files"] == files
    a, b = datasets.load_from_disk(str(tmp_path / "cache")), datasets.load_from_disk(str(tmp_path / "tasks"))
    assert a.column_names == b.column_names and len(a) == len(b) == len(full)
    for column in a.column_names:
        np.testing.assert_array_equal(a.with_format("numpy")[column], b.with_format("numpy")[column])
    assert main(["export", store, "--format", "saelens", "--layer", "1", "-o", str(tmp_path / "cli"),
                 "--hook-name", "blocks.0.hook_resid_post", "--workers", "2"]) == 0
    assert "blocks.0.hook_resid_post" in capsys.readouterr().out
    assert "blocks.0.hook_resid_post" in __import__("datasets").load_from_disk(str(tmp_path / "cli")).column_names


def test_saelens_trains_an_sae_from_the_export_alone(store, tmp_path):
    """SAELens's own ``ActivationsStore`` (no model, no dataset: ``cached_activations_path`` only) feeds its
    ``SAETrainer``; a few hundred steps of a small standard SAE lower its reconstruction error on held batches."""
    from sae_lens import StandardTrainingSAE, StandardTrainingSAEConfig
    from sae_lens.config import SAETrainerConfig
    from sae_lens.training.activations_store import ActivationsStore
    from sae_lens.training.sae_trainer import SAETrainer

    from actlake.jobs.export import export_saelens

    m = export_saelens(store, 1, tmp_path / "cache")
    acts = ActivationsStore(model=None, dataset=None, streaming=False, hook_name=m["hook_name"], hook_head_index=None,
                            context_size=m["context_size"], d_in=m["d_model"], n_batches_in_buffer=2,
                            total_training_tokens=10_000, store_batch_size_prompts=2, train_batch_size_tokens=64,
                            prepend_bos=False, normalize_activations="none", device=torch.device("cpu"),
                            dtype="float32", cached_activations_path=str(tmp_path / "cache"))
    held = torch.cat([acts.next_batch() for _ in range(4)])  # (256, d)
    torch.manual_seed(0)
    sae = StandardTrainingSAE(StandardTrainingSAEConfig(d_in=m["d_model"], d_sae=4 * m["d_model"], l1_coefficient=0.1,
                                                        dtype="float32", device="cpu"))
    mse = lambda: float(((sae.decode(sae.encode(held)) - held) ** 2).mean().detach())  # noqa: E731
    before = mse()
    cfg = SAETrainerConfig(total_training_samples=64 * 300, train_batch_size_samples=64, lr=1e-3, lr_end=1e-3,
                           n_batches_for_norm_estimate=2, dead_feature_window=50, feature_sampling_window=50)
    SAETrainer(cfg, sae, iter(acts.next_batch, None)).fit()
    assert mse() < 0.5 * before, (before, mse())


def _rows(folder, m):
    """The export's rows in order: (keys, activations)."""
    parts = [read_shard(folder, s, with_index=True) for s in m["shards"]]
    keys = [tuple(int(k) for k in key) for _, i in parts for key in zip(i["doc_id"], i["window_index"], i["position"])]
    return keys, torch.cat([h for h, _ in parts])


def test_roles_left_out_and_a_token_budget_a_uniform_prefix_of_the_order(store, tmp_path, capsys):
    every = _stored(store, 1)
    bos = set(every) - set(_stored(store, 1, "role <> 'bos'"))
    assert bos and all(p == 0 for _, _, p in bos)  # each window's leading BOS
    whole = export_tokens(store, 1, tmp_path / "all", shard_rows=100, seed=3, memory_mb=0.2, drop_roles=())
    keys, h = _rows(tmp_path / "all", whole)
    assert whole["rows"] == len(every) and set(keys) == set(every) and whole["drop_roles"] == []
    capped = export_tokens(store, 1, tmp_path / "cap", shard_rows=100, seed=3, memory_mb=0.2, drop_roles=(),
                           max_tokens=250)
    got, hc = _rows(tmp_path / "cap", capped)
    assert capped["rows"] == 250 and got == keys[:250] and torch.equal(hc, h[:250])  # the first 250 of the same order
    assert capped["mean_norm"] == pytest.approx(float(hc.double().norm(dim=1).mean()), rel=1e-12)
    eos_too = export_tokens(store, 1, tmp_path / "two", seed=3, memory_mb=0.2, drop_roles=("bos", "eos"))
    assert eos_too["rows"] == len(_stored(store, 1, "role NOT IN ('bos', 'eos')"))
    assert main(["export", store, "--format", "tokens", "--layer", "1", "-o", str(tmp_path / "x"),
                 "--drop-roles", "bos,cls"]) == 2
    assert "--drop-roles: cls is not a token role" in capsys.readouterr().err
    assert main(["export", store, "--format", "tokens", "--layer", "1", "-o", str(tmp_path / "cli"),
                 "--drop-roles", "none", "--max-tokens", "10"]) == 0
    assert "(10 rows of width 32 in 1 shard(s)" in capsys.readouterr().out


class _Stop(Exception):
    """A stop that is not actlake's own refusal (as a kill or an interrupt): the partial folder stays."""


@pytest.mark.parametrize("where", ["pass 1, inside the second store file", "pass 2, a shard after its bucket's record",
                                   "pass 2, between the record and removing the bucket",
                                   "the end, the manifest written and the folder not renamed"])
def test_a_stopped_export_resumes_to_the_same_bytes(store, tmp_path, monkeypatch, where):
    """Stopped at three points (as a kill would: no clean-up runs), the same command carries on and writes the
    bytes of an export that never stopped; another request is refused while the stopped one is there."""
    from actlake.jobs.export import tokens

    kwargs = dict(shard_rows=64, seed=11, memory_mb=0.2, drop_roles=())  # read batches of 64 rows: a file in several
    clean = export_tokens(store, 1, tmp_path / "clean", **kwargs)
    second = str(tokens.Store(store, 1).files[1][0])
    real_batches, real_write, real_atomic, seen = tokens.batches, tokens._write_shard, tokens.write_atomic, []

    def batches(path, *a):
        for n, part in enumerate(real_batches(path, *a)):
            yield part
            if where.startswith("pass 1") and str(path) == second and n == 1:
                raise _Stop(where)  # two read batches of the file spread

    def write_shard(*a):
        if "shard after" in where and (tmp_path / "out.partial" / "pass2.json").exists():
            seen.append("shard")
            if len(seen) == 2:  # the second shard after a bucket's record: one written, one stopped
                raise _Stop(where)
        return real_write(*a)

    def atomic(path, data):
        real_atomic(path, data)
        if path.name == "pass2.json" and "between" in where:
            raise _Stop(where)

    def remove_tree(path):
        if "the end" in where:
            raise _Stop(where)

    monkeypatch.setattr(tokens, "batches", batches)
    monkeypatch.setattr(tokens, "_write_shard", write_shard)
    monkeypatch.setattr(tokens, "write_atomic", atomic)
    monkeypatch.setattr(tokens, "remove_tree", remove_tree)
    with pytest.raises(_Stop):
        export_tokens(store, 1, tmp_path / "out", **kwargs)
    monkeypatch.undo()
    partial = tmp_path / "out.partial"
    assert partial.is_dir() and not (tmp_path / "out").exists()
    if where.startswith("pass 1"):
        assert [p.name for p in (partial / "buckets").glob("done-*")] == ["done-00000.json"]
        assert list((partial / "buckets").glob("h-*-00001.bin"))  # the second file's rows half spread
    else:
        assert (partial / "pass2.json").exists()
    if "the end" in where:  # finished: the rerun publishes it and computes nothing
        assert (partial / "manifest.json").exists()
        monkeypatch.setattr(tokens, "shuffle", lambda *a: pytest.fail("the finished export was computed again"))
    with pytest.raises(ConfigError, match=r"holds a stopped export of another request \(seed 11 there, 12 now\)"):
        export_tokens(store, 1, tmp_path / "out", **(kwargs | {"seed": 12}))
    again = export_tokens(store, 1, tmp_path / "out", **kwargs)
    monkeypatch.undo()
    assert again == clean | {"shards": again["shards"]} and again["shards"] == clean["shards"]
    assert not partial.exists()
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "clean").iterdir())
    for name in names:
        if name != "manifest.json":
            assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "clean" / name).read_bytes(), name


def test_the_shuffle_holds_at_most_memory_mb_on_data_ten_times_that(tmp_path):
    """benchmarks/export_memory.py at CI size (160,000 rows of width 64, 42 MiB, through --memory-mb 4): the arrays
    the shuffle holds at once (numpy's, traced by tracemalloc) stay within ``--memory-mb`` in both passes, in a
    process of its own; Parquet's reader adds its page buffers in pass 1 (Arrow's pool), a few MiB whatever the
    data's size, and pass 2 reads no Parquet."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "export_memory.py"), "--rows", "160000", "--d", "64",
                           "--memory-mb", "4", "--files", "4", "--json", str(tmp_path / "m.json")],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads((tmp_path / "m.json").read_text())
    mb = got["memory_mb"] * 2**20
    assert got["data"] > 10 * mb and got["rows"] == 160_000 and got["buckets"] >= 11, got
    assert got["pass1"] <= mb and got["pass2"] <= mb, got
    assert got["arrow1"] <= 8 * 2**20 and got["arrow2"] == got["arrow1"], got


def test_a_stopped_saelens_export_writes_the_rest(store, tmp_path, monkeypatch):
    """A stop in the second store file's task keeps the first file's Arrow file; the same command writes the rest and
    the dataset equals one written without a stop."""
    import datasets

    from actlake.jobs.export import saelens

    clean = saelens.export_saelens(store, 1, tmp_path / "clean")
    real, calls, stopped = saelens._write_arrow, [], []

    def write_arrow(staging, i, *a):
        calls.append(i)
        if i == 1 and not stopped:
            stopped.append(i)
            raise _Stop("second file")
        return real(staging, i, *a)

    monkeypatch.setattr(saelens, "_write_arrow", write_arrow)
    with pytest.raises(_Stop):
        saelens.export_saelens(store, 1, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out.partial").glob("data-*.arrow")) == ["data-00000-of-%05d.arrow"
                                                                                        % clean["files"]]
    del calls[:]
    again = saelens.export_saelens(store, 1, tmp_path / "out")
    assert calls[0] == 1 and 0 not in calls and again == clean  # the first file's task was not run again
    a, b = datasets.load_from_disk(str(tmp_path / "clean")), datasets.load_from_disk(str(tmp_path / "out"))
    for column in a.column_names:
        np.testing.assert_array_equal(a.with_format("numpy")[column], b.with_format("numpy")[column])
    assert not list((tmp_path / "out").glob("done-*")) and not (tmp_path / "out.partial").exists()


def test_the_job_writes_its_exports_as_the_command_does_and_keeps_them_on_a_rerun(store_job, tiny_models, sample_corpus,
                                                                                   tmp_path, capsys):
    """``activations.export`` in the store's own config (its run id unchanged: the run is complete, so the rerun runs
    no shard): both formats written after the job, equal to ``actlake export``'s; a second rerun keeps them."""
    import datasets

    from actlake.jobs.export import export_saelens

    cfg, run_dir = store_job
    entries = [{"format": "tokens", "layer": -1, "dir": str(tmp_path / "tok"), "seed": 5, "shard_rows": 50,
                "memory_mb": 0.2, "drop_roles": []},
               {"format": "saelens", "layer": 1, "dir": str(tmp_path / "sae"), "workers": 2}]
    with_exports = job_config(tiny_models["gpt_neox"], sample_corpus, Path(cfg.output.dir),
                              **STORE | {"activations.export": entries})
    assert with_exports.run_dir == cfg.run_dir
    res = run_job(with_exports)
    assert res.shards_run == 0
    printed = capsys.readouterr().out
    assert f"export:  {tmp_path / 'tok'}" in printed and f"export:  {tmp_path / 'sae'}" in printed
    last = max(r[0] for r in open_run(run_dir).sql("SELECT DISTINCT layer FROM activations").fetchall())
    want = export_tokens(run_dir, last, tmp_path / "tok-cli", seed=5, shard_rows=50, memory_mb=0.2, drop_roles=())
    got = json.loads((tmp_path / "tok" / "manifest.json").read_text())
    assert got == want | {"run": got["run"]} and got["layer"] == last
    for s in want["shards"]:
        assert (tmp_path / "tok" / s["file"]).read_bytes() == (tmp_path / "tok-cli" / s["file"]).read_bytes()
    export_saelens(run_dir, 1, tmp_path / "sae-cli")
    a, b = datasets.load_from_disk(str(tmp_path / "sae")), datasets.load_from_disk(str(tmp_path / "sae-cli"))
    for column in a.column_names:
        np.testing.assert_array_equal(a.with_format("numpy")[column], b.with_format("numpy")[column])
    before = (tmp_path / "tok" / "manifest.json").stat().st_mtime_ns
    run_job(with_exports)
    assert (tmp_path / "tok" / "manifest.json").stat().st_mtime_ns == before  # kept, not written again
    unstored = job_config(tiny_models["gpt_neox"], sample_corpus, Path(cfg.output.dir), **STORE | {
        "activations.export": [{"format": "tokens", "layer": 0, "dir": str(tmp_path / "none")}]})
    with pytest.raises(ConfigError, match=r"activations.export\[0\].layer: hidden state 0 is not stored \(activations"
                                          r".layers: \[1, -1\], a model of 2 blocks\)"):
        run_job(unstored)  # layers counted from the end: checked against the model's depth, before Ray


@pytest.mark.parametrize("entry, message", [
    ({"format": "tokens", "layer": 2, "dir": "x"}, "'activations.export.0.layer': hidden state 2 is not stored"),
    ({"format": "saelens", "layer": 1, "dir": "x", "seed": 3}, "'activations.export.0.seed': belongs to another format than saelens"),
    ({"format": "tokens", "layer": 1, "dir": "x", "drop_roles": ["cls"]}, "drop_roles"),
])
def test_a_bad_export_entry_is_one_line_naming_its_key(tiny_models, sample_corpus, tmp_path, entry, message):
    """(With layers counted from the end in ``activations.layers``, a layer is checked when the job knows the model's
    depth: the job test's ``layer: -1``.)"""
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        job_config(tiny_models["gpt_neox"], sample_corpus, tmp_path,
                   **STORE | {"activations.layers": [1, 3], "activations.export": [entry]})
    assert "\n" not in str(e.value) and "activations.export.0." in str(e.value)
    with pytest.raises(ConfigError, match=re.escape("'activations.export.1.dir': another export writes")):
        job_config(tiny_models["gpt_neox"], sample_corpus, tmp_path,
                   **STORE | {"activations.export": [{"format": "tokens", "layer": 1, "dir": "y"},
                                                     {"format": "saelens", "layer": 1, "dir": "y"}]})


def test_every_exported_row_is_the_model_s_hidden_state_and_its_token(store, tiny_models, tmp_path):
    """Against float64 transformers (the store is float16: its rounding is the tolerance): every row of the token
    export at hidden state 1 and the last, and its token id, as the ``tokens`` table has it."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(tiny_models["gpt_neox"], torch_dtype=torch.float64).eval()
    con = open_run(store)
    windows: dict = {}
    for doc, win, tid in con.sql("SELECT doc_id, window_index, token_id FROM tokens "
                                 "ORDER BY doc_id, window_index, position").fetchall():
        windows.setdefault((doc, win), []).append(tid)
    for layer in (1, model.config.num_hidden_layers):
        m = export_tokens(store, layer, tmp_path / f"l{layer}", drop_roles=(), memory_mb=0.2, shard_rows=100)
        keys, h = _rows(tmp_path / f"l{layer}", m)
        ids = np.concatenate([read_shard(tmp_path / f"l{layer}", s, with_index=True)[1]["token_id"] for s in m["shards"]])
        ref = {}
        with torch.no_grad():
            for (doc, win) in {(k[0], k[1]) for k in keys}:
                ref[doc, win] = model(input_ids=torch.tensor([windows[doc, win]]),
                                      output_hidden_states=True).hidden_states[layer][0]
        want = torch.stack([ref[d, w][p] for d, w, p in keys])
        scale = float(want.abs().max())
        assert float((h.double() - want).abs().max()) <= 2e-3 * scale
        assert ids.tolist() == [windows[d, w][p] for d, w, p in keys]


def test_both_exports_to_an_object_store_equal_the_local_ones_and_resume(store, s3_server, tmp_path, monkeypatch):
    """``-o s3://...`` (moto's server on 127.0.0.1): the objects are the local export's files byte for byte (the
    manifest / state last), the token reader streams from the prefix, a stopped export resumes from its scratch
    folder (the shards already uploaded stay), and a prefix that holds an export, or another's objects, is refused."""
    from actlake.fs import location
    from actlake.jobs.export import saelens, tokens

    bucket = s3_server("exports")
    kwargs = dict(shard_rows=64, seed=2, memory_mb=0.2)
    local = export_tokens(store, 1, tmp_path / "tok", **kwargs)
    real = tokens._Progress.commit
    calls = []

    def stop_at_the_third(self, b):
        calls.append(b)
        if len(calls) == 3:
            raise _Stop("after two buckets")
        return real(self, b)

    monkeypatch.setattr(tokens._Progress, "commit", stop_at_the_third)
    with pytest.raises(_Stop):
        export_tokens(store, 1, f"{bucket}/tok", scratch=tmp_path / "scratch", **kwargs)
    monkeypatch.undo()
    uploaded = location(f"{bucket}/tok").sizes()
    assert uploaded and "manifest.json" not in uploaded  # shards of the first buckets are there; no manifest yet
    seen = len(s3_server.requests)
    remote = export_tokens(store, 1, f"{bucket}/tok", scratch=tmp_path / "scratch", **kwargs)
    assert remote == local | {"shards": remote["shards"]} and remote["shards"] == local["shards"]
    writes = [path for method, path in s3_server.requests[seen:] if method in ("PUT", "POST") and "/tok/" in path]
    assert writes and writes[-1].endswith("/tok/manifest.json")  # the manifest last: readers see all or nothing
    objects = location(f"{bucket}/tok")
    assert sorted(objects.sizes()) == sorted(p.name for p in (tmp_path / "tok").iterdir())
    for p in (tmp_path / "tok").iterdir():
        if p.name != "manifest.json":
            assert (objects / p.name).read_bytes() == p.read_bytes(), p.name
    assert torch.equal(torch.cat(list(iterate(f"{bucket}/tok", 100))), torch.cat(list(iterate(tmp_path / "tok", 100))))
    assert not list((tmp_path / "scratch" / "actlake-exports").iterdir())  # the scratch folder is gone
    with pytest.raises(ConfigError, match="holds an export"):
        export_tokens(store, 1, f"{bucket}/tok", **kwargs)
    (location(f"{bucket}/other") / "mine.txt").write_text("mine")
    with pytest.raises(ConfigError, match="holds objects, and .* no stopped export to it: resume a stopped export with the --scratch"):
        export_tokens(store, 1, f"{bucket}/other", scratch=tmp_path / "scratch", **kwargs)
    assert (location(f"{bucket}/other") / "mine.txt").read_text() == "mine"

    saelens.export_saelens(store, 1, tmp_path / "sae")
    from actlake.jobs.export import store as staging_module

    real_upload = staging_module.upload

    def upload(local, target):  # a stop while state.json goes up: everything else is there, and no state yet
        if target.name == "state.json":
            raise _Stop("uploading state.json")
        real_upload(local, target)

    monkeypatch.setattr(staging_module, "upload", upload)
    with pytest.raises(_Stop):
        saelens.export_saelens(store, 1, f"{bucket}/sae", scratch=tmp_path / "scratch")
    monkeypatch.undo()
    assert "state.json" not in location(f"{bucket}/sae").sizes()
    monkeypatch.setattr(saelens, "run_tasks", lambda *a: pytest.fail("the finished export was computed again"))
    saelens.export_saelens(store, 1, f"{bucket}/sae", scratch=tmp_path / "scratch")
    monkeypatch.undo()
    got = location(f"{bucket}/sae").sizes()
    assert sorted(got) == sorted(p.name for p in (tmp_path / "sae").iterdir())
    for p in (tmp_path / "sae").iterdir():
        if p.name != "state.json":  # its fingerprint is new each time
            assert (location(f"{bucket}/sae") / p.name).read_bytes() == p.read_bytes(), p.name


KILLED = """
import os, signal, sys
from actlake.jobs.cli import main
from actlake.jobs.export import tokens
real, n = tokens._write_shard, []
def write_shard(*a):
    n.append(1)
    if len(n) == int(sys.argv[1]):
        os.kill(os.getpid(), signal.SIGKILL)  # kill -9: no clean-up runs, the lock's holder is gone
    return real(*a)
tokens._write_shard = write_shard
sys.exit(main(sys.argv[2:]))
"""


def test_an_export_killed_with_sigkill_resumes_to_the_same_bytes(store, tmp_path):
    import signal
    import subprocess
    import sys

    args = ["export", store, "--format", "tokens", "--layer", "1", "--shard-rows", "64", "--memory-mb", "0.2",
            "--seed", "4"]
    assert main(args + ["-o", str(tmp_path / "clean")]) == 0
    killed = subprocess.run([sys.executable, "-c", KILLED, "7", *args, "-o", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert (tmp_path / "out.partial" / "pass2.json").exists() and not (tmp_path / "out").exists()
    assert main(args + ["-o", str(tmp_path / "out")]) == 0
    names = sorted(p.name for p in (tmp_path / "clean").iterdir())
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == names
    for name in names:
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "clean" / name).read_bytes(), name


def test_a_second_export_to_the_same_folder_is_refused_while_the_first_works(store, tmp_path):
    from actlake.jobs.export import tokens

    kwargs = dict(shard_rows=64, seed=1, memory_mb=0.2)
    request = {"kind": "tokens"}  # whatever the first one asked: the folder is held
    with tokens.Staging(tmp_path / "out", request):
        with pytest.raises(ConfigError, match="is being written by another export; wait for it to end"):
            export_tokens(store, 1, tmp_path / "out", **kwargs)
        assert (tmp_path / "out.partial" / "request.json").exists()  # the first's folder untouched


def test_a_long_export_says_how_far_it_is(store, tmp_path, monkeypatch, caplog):
    """Progress lines for each pass (every PROGRESS_S seconds; here every step), with the share done and, before the
    end, the time left."""
    import logging

    from actlake.jobs.export import store as staging_module

    monkeypatch.setattr(staging_module, "PROGRESS_S", 0.0)
    n_files = len(staging_module.Store(store, 1).files)
    with caplog.at_level(logging.INFO, logger="actlake.export"):
        m = export_tokens(store, 1, tmp_path / "out", shard_rows=64, memory_mb=0.2)
    lines = [r.getMessage() for r in caplog.records]
    pass1 = [ln for ln in lines if ln.startswith("export pass 1 (rows to buckets), store files: ")]
    pass2 = [ln for ln in lines if ln.startswith("export pass 2 (buckets shuffled into shards), buckets: ")]
    assert len(pass1) == n_files and pass1[-1].endswith(f"{n_files} of {n_files} (100 %)")
    assert "s left" in pass1[0] or n_files == 1
    assert len(pass2) == 10 and pass2[-1].endswith("10 of 10 (100 %)") and m["rows"] > 0  # 10 buckets: the fewest


def test_the_store_is_announced_with_its_size_and_a_layer_from_the_end_is_checked_naming_its_entry(
        tiny_models, sample_corpus, tmp_path):
    """ActivationSample.plan_note: the stored hidden states, bytes per token and the bound, from the model's own
    config.json (worked out here); none for a streamed dataset. An export's layer counted from the end beyond the
    model is refused naming activations.export[i].layer (not activations.layers)."""
    from actlake.analysis.activation_sample import META_BYTES, ActivationSample
    from actlake.jobs.extract.run import export_layers

    hf = json.loads((Path(tiny_models["gpt_neox"]) / "config.json").read_text())
    n, d = hf["num_hidden_layers"], hf["hidden_size"]
    cfg = job_config(tiny_models["gpt_neox"], sample_corpus, tmp_path, **STORE | {"activations.fraction": 0.25})
    per_token = 2 * (d * 2 + META_BYTES)  # two float16 hidden states and each row's ids
    bound = 7 * cfg.tokenization.max_windows_per_doc * 200 * 0.25 * per_token
    assert ActivationSample.plan_note(cfg, 7) == (
        f"activation store: hidden states {[1, n]}, d = {d}, float16: {per_token:,} bytes per token before "
        f"compression; at most {bound / 2**30:,.2f} GiB for 7 documents (fraction 0.25 of windows)")
    assert ActivationSample.plan_note(cfg, None) is None
    far = job_config(tiny_models["gpt_neox"], sample_corpus, tmp_path, **STORE | {
        "activations.export": [{"format": "tokens", "layer": 1, "dir": str(tmp_path / "a")},
                               {"format": "tokens", "layer": -n - 2, "dir": str(tmp_path / "b")}]})
    with pytest.raises(ConfigError, match=re.escape(f"activations.export[1].layer: layer {-n - 2} out of range for a "
                                                    f"model with {n} layers (hidden states 0..{n})")):
        export_layers(far)
