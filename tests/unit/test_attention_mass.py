import numpy as np
import pytest
import torch

from actlake.analysis.attention_mass import AttentionMass, allowed_pairs, expand_kv
from actlake.analysis.layer_qk import BatchInfo, LayerQK
from actlake.categories import one_hot


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h_kv", [4, 2])
def test_one_hot_value_mass_equals_explicit_weights(causal, h_kv):
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
    stats.add_layer(LayerQK(0, q, k, d ** -0.5, BatchInfo(valid, causal, onehot, onehot)))
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
    a.mass[:] = np.random.default_rng(0).random(a.mass.shape)
    a.n_queries[:] = 7
    a.nonfinite[:] = [2, 0]
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


@pytest.mark.parametrize("causal", [False, True])
def test_mass_with_rescaled_keys_equals_explicit_softmax(causal):
    g = torch.Generator().manual_seed(3)
    B, H, T, d, C = 2, 4, 7, 8, 5
    q, k = torch.randn(B, H, T, d, generator=g), torch.randn(B, 2, T, d, generator=g)
    valid = torch.ones(B, T, dtype=torch.long)
    valid[1, 5:] = 0
    onehot = one_hot(torch.randint(0, C, (B, T), generator=g), C, valid)
    scale = torch.rand(B, H, T, generator=g) + 0.5
    lq = LayerQK(0, q, k, d ** -0.5, BatchInfo(valid, causal, onehot, onehot))
    ((_, _, alpha),) = list(lq.attention_chunks(key_scale=scale))
    v = valid.bool()[:, None, :, None]
    torch.testing.assert_close(lq.per_query_mass(scale) * v, torch.matmul(alpha, onehot.float()[:, None]) * v,
                               rtol=1e-5, atol=1e-6)


def test_weights_in_query_blocks_equal_the_whole_layer():
    g = torch.Generator().manual_seed(4)
    B, H, T, d, C = 2, 3, 9, 4, 5
    q, k = torch.randn(B, H, T, d, generator=g), torch.randn(B, H, T, d, generator=g)
    valid = torch.ones(B, T, dtype=torch.long)
    valid[0, 6:] = 0
    onehot = one_hot(torch.zeros(B, T, dtype=torch.long), C, valid)
    lq = LayerQK(0, q, k, 0.5, BatchInfo(valid, True, onehot, onehot))
    ((_, _, whole),) = list(lq.attention_chunks())
    blocks = list(lq.attention_chunks(max_elements=B * H * T * 2))  # two queries per block
    assert len(blocks) == 5 and [b[0] for b in blocks] == [0, 2, 4, 6, 8]
    torch.testing.assert_close(torch.cat([b[2] for b in blocks], dim=2), whole)
    scale = torch.rand(B, H, T, generator=g) + 0.5
    ((_, _, whole_s),) = list(lq.attention_chunks(key_scale=scale))
    blocks_s = list(lq.attention_chunks(key_scale=scale, max_elements=B * H * T * 2))
    torch.testing.assert_close(torch.cat([b[2] for b in blocks_s], dim=2), whole_s)
    assert torch.all(whole[0, :, 6:] == 0)  # padded queries give no weight
