import numpy as np
import pytest
import torch

from actlake.analysis.attention_mass import AttentionMass
from actlake.analysis.engine.heads import allowed_pairs, expand_kv
from actlake.analysis.engine.layer_qk import BatchInfo, LayerQK
from actlake.categories import one_hot


@pytest.mark.parametrize("method", ["fused", "explicit"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h_kv", [4, 2])
def test_mass_equals_explicit_softmax_weights(causal, h_kv, method):
    """Both paths: one-hot V through the fused kernel, and explicit weights in blocks."""
    g = torch.Generator().manual_seed(0)
    B, H, T, d, C = 3, 4, 9, 8, 5
    q = torch.randn(B, H, T, d, generator=g) * 2
    k = torch.randn(B, h_kv, T, d, generator=g) * 2
    valid = torch.ones(B, T, dtype=torch.long)
    valid[1, 6:] = 0
    valid[2, 3:] = 0
    cats = torch.randint(0, C, (B, T), generator=g)
    onehot = one_hot(cats, C, valid)
    stats = AttentionMass.zeros(1, H, C)
    stats.add_layer(LayerQK(0, q, k, d ** -0.5, BatchInfo(valid, causal, onehot, onehot), method=method,
                            max_elements=H * T * 2))  # explicit: blocks of two queries
    # brute force: explicit softmax weights, loops over query and key
    kk = expand_kv(k, H)
    mass = np.zeros((H, C, C))
    for b in range(B):
        n_valid = int(valid[b].sum())
        for h in range(H):
            for m in range(n_valid):
                keys = [n for n in range(n_valid) if not causal or n <= m]
                logits = torch.stack([(q[b, h, m] @ kk[b, h, n]).double() * d ** -0.5 for n in keys])
                w = torch.softmax(logits, 0)
                for n, wn in zip(keys, w):
                    mass[h, cats[b, m], cats[b, n]] += float(wn)
    np.testing.assert_allclose(stats.mass[0], mass, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats.mass[0].sum((1, 2)), valid.sum().item(), rtol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_a_learned_sink_takes_its_share_as_key_category_sink(causal):
    """Sinks (H,) far apart: the brute-force softmax over [the keys' logits, the sink] per query; the mass on
    keys and the sink's share sum to 1 per query; the halves of a batch merge to the whole."""
    g = torch.Generator().manual_seed(1)
    B, H, T, d, C = 2, 4, 7, 8, 5
    q, k = torch.randn(B, H, T, d, generator=g) * 2, torch.randn(B, 2, T, d, generator=g) * 2
    sinks = torch.tensor([-3.0, 0.0, 1.5, 4.0])
    valid = torch.ones(B, T, dtype=torch.long)
    valid[1, 4:] = 0
    cats = torch.randint(0, C, (B, T), generator=g)
    onehot = one_hot(cats, C, valid)

    def stats(rows):
        s = AttentionMass.zeros(1, H, C)
        s.add_layer(LayerQK(0, q[rows], k[rows], d ** -0.5, BatchInfo(valid[rows], causal, onehot[rows], onehot[rows]),
                            sinks=sinks, max_elements=H * T * 3))
        return s
    whole = stats(slice(None))
    kk = expand_kv(k, H)
    mass, sink = np.zeros((H, C, C)), np.zeros((H, C))
    for b in range(B):
        n_valid = int(valid[b].sum())
        for h in range(H):
            for m in range(n_valid):
                keys = [n for n in range(n_valid) if not causal or n <= m]
                logits = [float(q[b, h, m].double() @ kk[b, h, n].double()) * d ** -0.5 for n in keys]
                w = torch.softmax(torch.tensor(logits + [float(sinks[h])], dtype=torch.float64), 0)
                for n, wn in zip(keys, w[:-1]):
                    mass[h, cats[b, m], cats[b, n]] += float(wn)
                sink[h, cats[b, m]] += float(w[-1])
    np.testing.assert_allclose(whole.mass[0], mass, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(whole.sink[0], sink, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(whole.mass[0].sum(-1) + whole.sink[0], whole.n_queries[0][None].expand(H, C), rtol=1e-6)
    halves = stats(slice(0, 1)).merge(stats(slice(1, 2)))
    np.testing.assert_allclose(halves.sink, whole.sink, rtol=1e-12)
    table = whole.to_arrow()
    assert set(table["key_category"].to_pylist()) == {"bos", "eos", "period", "comma", "other", "sink"}
    back = AttentionMass.from_arrow(table)
    np.testing.assert_array_equal(back.sink, whole.sink)
    np.testing.assert_array_equal(back.mass, whole.mass)


def test_merge_and_arrow_roundtrip():
    a = AttentionMass.zeros(2, 3)
    a.mass[:] = torch.from_numpy(np.random.default_rng(0).random(tuple(a.mass.shape)))
    a.n_queries[:] = 7
    a.nonfinite[:] = torch.tensor([2.0, 0.0])
    b = AttentionMass.from_arrow(a.to_arrow())
    np.testing.assert_array_equal(b.nonfinite, a.nonfinite)
    np.testing.assert_array_equal(b.mass, a.mass)
    np.testing.assert_array_equal(b.n_queries, a.n_queries)
    np.testing.assert_array_equal(a.merge(b).mass, 2 * a.mass)
    assert "sink" not in a.to_arrow()["key_category"].to_pylist()  # no sink rows for a model without sinks
    np.testing.assert_array_equal(b.sink, 0)


def test_allowed_pairs_respects_padding_and_causality():
    valid = torch.tensor([[1, 1, 1, 0]])
    m = allowed_pairs(valid, causal=True)[0, 0]
    assert m.tolist() == [[True, False, False, False], [True, True, False, False],
                          [True, True, True, False], [True, True, True, False]]


