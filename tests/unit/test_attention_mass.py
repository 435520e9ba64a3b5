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


def test_allowed_pairs_respects_padding_and_causality():
    valid = torch.tensor([[1, 1, 1, 0]])
    m = allowed_pairs(valid, causal=True)[0, 0]
    assert m.tolist() == [[True, False, False, False], [True, True, False, False],
                          [True, True, True, False], [True, True, True, False]]


