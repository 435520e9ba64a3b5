"""``actlake export RUN --format tokens`` (issue 52, step 2): every stored token once, in a seeded global order, in
fixed-size shards with their index and the mean norm, out of core; ``actlake.activations.iterate`` streams it."""

from __future__ import annotations

import json

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


@pytest.fixture(scope="module")
def store(tiny_models, sample_corpus, tmp_path_factory, ray_local):
    cfg = job_config(tiny_models["gpt_neox"], sample_corpus, tmp_path_factory.mktemp("store"),
                     **{"analyses.contributions": False, "analyses.geometry": False,
                        "analyses.attention_by_distance": False, "corpus.max_docs": 12,
                        "activations.layers": [1, -1], "activations.dtype": "float16",
                        "tokenization.max_length": 200})  # long enough that some documents end inside a window
    return run_job(cfg).run_dir


def _stored(run_dir, layer):
    rows = open_run(run_dir).sql(f"SELECT doc_id, window_index, position, token_id, h FROM activations "
                                 f"WHERE layer = {layer}").fetchall()
    return {(d, w, p): (t, np.asarray(h, np.float32)) for d, w, p, t, h in rows}


def test_every_token_once_shuffled_by_the_seed_with_its_index_and_mean_norm(store, tmp_path):
    want = _stored(store, 1)
    m = export_tokens(store, 1, tmp_path / "a", shard_rows=100, seed=7, memory_mb=0.05)
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
    again = export_tokens(store, 1, tmp_path / "b", shard_rows=100, seed=7, memory_mb=0.05, workers=2)  # Ray tasks
    other = export_tokens(store, 1, tmp_path / "c", shard_rows=100, seed=8, memory_mb=0.05)
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
    assert not list(tmp_path.glob("*.partial-*"))
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
    assert not (tmp_path / "none").exists() and not list(tmp_path.glob("*.partial-*"))
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
