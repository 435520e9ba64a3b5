"""One pass over explicit attention weights (and the fused one-hot-V path) against explicit softmax
weights built the plain way, with padding, causality, grouped-query heads and every block size."""

from __future__ import annotations

import pytest
import torch

from actlake.analysis.engine.heads import expand_kv
from actlake.analysis.engine.attention_weights import PRODUCTS, explicit_products, fused_products, key_norm_scale
from actlake.analysis.engine.layer_qk import BatchInfo, LayerQK
from actlake.categories import one_hot


def _valid(kind: str) -> torch.Tensor:
    """(B, T) masks. ends: right padding; hole: also a token excluded mid-sequence (as non-finite ones
    are); edges: left padding, an all-padded sequence, a single valid token; one_token: T = 1;
    ends_float: ends as a float mask."""
    if kind == "one_token":
        return torch.ones(2, 1, dtype=torch.long)
    valid = torch.ones(3, 9, dtype=torch.long)
    if kind == "edges":
        valid[0, :3] = 0
        valid[1] = 0
        valid[2, 1:] = 0
        return valid
    valid[1, 6:] = 0
    valid[2, 3:] = 0
    if kind == "hole":
        valid[0, 2] = 0
    return valid.float() if kind == "ends_float" else valid


def _layer(causal: bool, h_kv: int = 2, seed: int = 0, kind: str = "ends"):
    g = torch.Generator().manual_seed(seed)
    valid = _valid(kind)
    (B, T), H, d, C = valid.shape, 4, 8, 5
    q = torch.randn(B, H, T, d, generator=g) * 2
    k = torch.randn(B, h_kv, T, d, generator=g) * 2
    v = torch.randn(B, h_kv, T, d, generator=g)
    onehot = one_hot(torch.randint(0, C, (B, T), generator=g), C, valid)
    return LayerQK(0, q, k, d ** -0.5, BatchInfo(valid, causal, onehot, onehot)), v


def _reference(lq, v, key_scale=None):
    """Weights the plain way: full (B, H, T, T) logits, masked, softmax; padded query rows zeroed."""
    k = expand_kv(lq.key, lq.n_heads).double()
    if key_scale is not None:
        k = k * key_scale[..., None].double()
    logits = torch.matmul(lq.query.double(), k.transpose(-1, -2)) * lq.scaling
    logits = logits.masked_fill(~lq.batch.pair_mask, float("-inf"))
    alpha = torch.softmax(logits, -1)
    out = torch.matmul(alpha, expand_kv(v, lq.n_heads).double())  # valid query rows only are compared
    return torch.nan_to_num(alpha) * lq.valid[:, None, :, None], out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h_kv,kind", [(4, "ends"), (2, "ends"), (2, "hole"), (2, "ends_float"), (2, "edges"),
                                        (1, "one_token")])
@pytest.mark.parametrize("max_elements", [None, 4 * 9 * 9 * 2, 4 * 9 * 2, 1])
def test_explicit_products_equal_plain_softmax_weights(causal, h_kv, kind, max_elements):
    """max_elements (T = 9): one block; two sequences a block; two queries a block; one query a block."""
    lq, v = _layer(causal, h_kv, kind=kind)
    got = explicit_products(lq, PRODUCTS, v, max_elements)
    alpha, out = _reference(lq, v)
    oh = lq.key_onehot.double()[:, None]
    torch.testing.assert_close(got["mass"].double(), torch.matmul(alpha, oh), rtol=1e-5, atol=1e-6)
    alpha_kn, _ = _reference(lq, v, key_norm_scale(lq))
    torch.testing.assert_close(got["mass_keynorm"].double(), torch.matmul(alpha_kn, oh), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["weighted_qsum"].double(), torch.matmul(alpha.transpose(-1, -2), lq.query.double()),
                               rtol=1e-5, atol=1e-5)
    B, H, T, _ = alpha.shape
    dist = torch.zeros(H, 2 * T - 1, dtype=torch.float64)
    for m in range(T):
        for n in range(T):
            dist[:, m - n + T - 1] += alpha[:, :, m, n].sum(0)
    torch.testing.assert_close(got["distance"], dist, rtol=1e-6, atol=1e-6)
    assert not any(torch.isnan(t).any() for t in got.values())
    if kind != "hole":  # the output is the model's only where the statistics' mask is the model's
        real = lq.valid.bool()[:, None, :, None].expand_as(out)
        torch.testing.assert_close(got["output"].double()[real], out[real], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_fused_one_hot_value_mass_equals_explicit(causal):
    lq, _ = _layer(causal, h_kv=2, seed=3)
    fused = fused_products(lq, {"mass", "mass_keynorm"})
    explicit = explicit_products(lq, {"mass", "mass_keynorm"})
    for name in ("mass", "mass_keynorm"):
        torch.testing.assert_close(fused[name], explicit[name], rtol=1e-5, atol=1e-6)
    assert torch.all(fused["mass"][2, :, 3:] == 0)  # padded queries give nothing
    with pytest.raises(ValueError, match="explicit"):
        fused_products(lq, {"distance"})


def test_products_are_computed_once_and_together():
    lq, _ = _layer(True)
    lq.needs = frozenset({"mass", "distance"})
    lq.product("mass")
    assert {"mass", "distance"} <= lq._cache.keys() and "weighted_qsum" not in lq._cache
    lq.product("weighted_qsum")  # not declared: a second pass computes only it
    assert "weighted_qsum" in lq._cache


def test_value_heads_of_another_size():
    """The output takes the value's width and the masses riding along with it stay right."""
    lq, _ = _layer(False, h_kv=2, seed=5)
    v = torch.randn(*lq.key.shape[:3], 5)  # d_v = 5 < d_h = 8
    got = explicit_products(lq, {"output", "mass"}, v)
    alpha, out = _reference(lq, v)
    real = lq.valid.bool()[:, None, :, None].expand_as(out)
    assert got["output"].shape == out.shape
    torch.testing.assert_close(got["output"].double()[real], out[real], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["mass"].double(), torch.matmul(alpha, lq.key_onehot.double()[:, None]),
                               rtol=1e-5, atol=1e-6)


def test_reverse_cumsum_by_product_equals_the_scan():
    """The GPU's causal sum over queries (a product with a triangular matrix) against the CPU's scan."""
    from actlake.analysis.engine.layer_qk import reverse_cumsum_by_product

    g = torch.Generator().manual_seed(5)
    for shape in ((2, 3, 9, 4), (2, 1, 9)):
        x = torch.randn(*shape, generator=g, dtype=torch.float64)
        torch.testing.assert_close(reverse_cumsum_by_product(x), x.flip(2).cumsum(2).flip(2), rtol=1e-12, atol=1e-12)


def test_diagonal_sums_by_skew_equal_the_scatter():
    """The GPU's distance profile of a block of query rows (skewed rows) against index_add_ by m - n."""
    from actlake.analysis.engine.attention_weights import diagonal_sums_from

    g = torch.Generator().manual_seed(6)
    H, T = 3, 11
    for m0, M in ((0, T), (0, 4), (4, 4), (8, 3)):
        rows = torch.rand(H, M, T, generator=g)
        m = torch.arange(m0, m0 + M)
        index = (m[:, None] - torch.arange(T)[None, :] + T - 1).reshape(-1)
        want = torch.zeros(H, 2 * T - 1, dtype=torch.float64).index_add_(1, index, rows.reshape(H, -1).double())
        got = torch.zeros(H, 2 * T - 1, dtype=torch.float64)
        span = diagonal_sums_from(rows)
        got[:, m0 : m0 + span.shape[1]] += span
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_causal_blocks_of_one_sequence_give_the_plain_softmax_products():
    """Causal blocks of one sequence each, padded and unpadded: mass and the distance profile equal
    those of plain softmax weights."""
    g = torch.Generator().manual_seed(7)
    B, H, T, d, C = 3, 2, 8, 4, 5
    q, k = torch.randn(B, H, T, d, generator=g), torch.randn(B, H, T, d, generator=g)
    valid = torch.ones(B, T, dtype=torch.long)
    valid[2, 5:] = 0  # one padded sequence: its block takes the other path
    onehot = one_hot(torch.randint(0, C, (B, T), generator=g), C, valid)
    lq = LayerQK(0, q, k, d ** -0.5, BatchInfo(valid, True, onehot, onehot))
    got = explicit_products(lq, {"mass", "distance"}, max_elements=H * T * T)  # one sequence per block
    w = torch.softmax((q @ k.transpose(-1, -2) * d ** -0.5).masked_fill(~lq.batch.weight_mask, float("-inf")), -1)
    w = w * valid[:, None, :, None]
    torch.testing.assert_close(got["mass"], w @ onehot.float()[:, None], rtol=1e-5, atol=1e-6)
    m = torch.arange(T)
    index = (m[:, None] - m[None, :] + T - 1).reshape(-1)
    want = torch.zeros(H, 2 * T - 1, dtype=torch.float64).index_add_(1, index, w.sum(0).reshape(H, -1).double())
    torch.testing.assert_close(got["distance"], want, rtol=1e-5, atol=1e-6)
