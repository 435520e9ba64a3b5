"""Per-dimension contributions and attention geometry: identities and brute-force references,
on tiny random models of every supported family (RoPE, partial rotary, GQA, biases), with padding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actlake.analysis.attention_distance import AttentionByDistance
from actlake.analysis.contributions import QUERY_GROUPS_BY_ROLE, Contributions
from actlake.analysis.engine import capture
from actlake.analysis.engine.layer_qk import LayerQK
from actlake.analysis.engine.recorder import AttentionRecorder, ModelQK
from actlake.analysis.geometry import Geometry
from actlake.categories import ROLE, one_hot
from actlake.config import ModelConfig
from actlake.model import load_model
from tests.conftest import FAMILIES
from tests.rope_reference import rotate, unrotate

pytestmark = pytest.mark.integration


def capture_layers(model_path, attn="sdpa", seed=0):
    """Run a padded batch; return (loaded model, [LayerQK per layer], output)."""
    lm = load_model(ModelConfig(name_or_path=str(model_path), attn_implementation=attn))
    capture.install(lm.model)
    mqk = ModelQK(lm.model, lm.family)
    g = torch.Generator().manual_seed(seed)
    vocab = lm.model.config.vocab_size
    B, T = 3, 11
    ids = torch.randint(5, min(vocab, 1000), (B, T), generator=g)
    valid = torch.ones(B, T, dtype=torch.long)
    valid[1, 7:] = 0
    valid[2, 4:] = 0
    role = torch.randint(0, len(ROLE), (B, T), generator=g)
    layers = []
    with capture.LayerInputs(lm.model, lm.family) as inputs:
        rec = AttentionRecorder(mqk, valid, one_hot(role, len(ROLE), valid), [layers.append], inputs=inputs)
        with torch.no_grad(), capture.recording(rec):
            out = lm.model(input_ids=ids, attention_mask=valid, output_attentions=(attn == "eager"))
    return lm, layers, out


def pairwise_contributions(lq: LayerQK, b: int, h: int) -> torch.Tensor:
    """C (T, T, d) float64 for one sequence and head, every pair, O(T^2 d): C(m, n) = u(m, n) * x_n with
    u(m, n) = W_K R_n^T q'_m (times the key's 1 / r_n under a key norm)."""
    q = lq.query[b, h]  # (T, d_h)
    w = lq.w_key[h // (lq.n_heads // lq.w_key.shape[0])]  # (d, d_h): the query head's key head
    T = q.shape[0]
    out = torch.zeros(T, T, lq.x.shape[-1], dtype=torch.float64)
    for n in range(T):
        qn = q
        if lq.cos is not None:  # R_n^T q'_m for every m, with the key's angle
            qn = unrotate(q[None, None], lq.cos[b : b + 1, n : n + 1].expand(1, T, -1),
                          lq.sin[b : b + 1, n : n + 1].expand(1, T, -1), lq.unrotation[2])[0, 0]
        u = qn.double() @ w.double().T  # (T, d): u(m, n) for all m
        if lq.key_scale is not None:
            u = u * float(lq.key_scale_per_query_head[b, h, n])
        out[:, n] = u * lq.x[b, n].double()
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_contributions_sum_to_the_models_scores(family, tiny_models):
    lm, layers, _ = capture_layers(tiny_models[family])
    assert len(layers) == lm.model.config.num_hidden_layers
    if family in ("gpt_neox", "llama"):
        assert layers[0].cos is not None
    for lq in layers:
        for b in range(lq.query.shape[0]):
            n_valid = int(lq.valid[b].sum())
            for h in range(lq.n_heads):
                C = pairwise_contributions(lq, b, h)[:n_valid, :n_valid]  # (T, T, d)
                q = lq.query[b, h, :n_valid].double()
                k = lq.key_per_query_head[b, h, :n_valid].double()
                S = q @ k.T  # the model's own pre-softmax scores (unscaled)
                bias = torch.zeros_like(S)
                if lq.b_key is not None:
                    rep = lq.n_heads // lq.b_key.shape[0]
                    bk = lq.b_key[h // rep][None, None, None].expand(1, 1, n_valid, -1)  # (1, 1, T, d_h)
                    if lq.cos is not None:  # the bias is rotated with its key: R_n b_K
                        bk = rotate(bk, lq.cos[b : b + 1, :n_valid], lq.sin[b : b + 1, :n_valid])
                    bias = q @ bk[0, 0].double().T
                torch.testing.assert_close(C.sum(-1) + bias, S, rtol=1e-4, atol=1e-4)


def _key_bias(lq, b, h):
    """(T, d_h) float64: R_n b_K for every key position n of sequence b (zeros without a key bias)."""
    T, dh = lq.query.shape[2], lq.query.shape[3]
    if lq.b_key is None:
        return torch.zeros(T, dh, dtype=torch.float64)
    bk = lq.b_key[h // (lq.n_heads // lq.b_key.shape[0])][None, None, None].expand(1, 1, T, -1)
    if lq.cos is not None:
        bk = rotate(bk, lq.cos[b : b + 1], lq.sin[b : b + 1])
    return bk[0, 0].double()


def _brute_force(lq, alpha):
    """Loops over sequences, heads and valid pairs."""
    H, C = lq.n_heads, len(ROLE)
    d = lq.x.shape[-1]
    contrib = np.zeros((H, len(QUERY_GROUPS_BY_ROLE), C, d))
    bias = np.zeros((H, len(QUERY_GROUPS_BY_ROLE), C))
    pairs = np.zeros((len(QUERY_GROUPS_BY_ROLE), C))
    weighted = np.zeros((H, C, d))
    weighted_bias = np.zeros((H, C))
    qn = np.zeros((H, C)); kn = np.zeros((H, C)); cos = np.zeros((H, C))
    kcat = lq.key_onehot.argmax(-1)
    for b in range(lq.query.shape[0]):
        n_valid = int(lq.valid[b].sum())
        for h in range(H):
            Cb = pairwise_contributions(lq, b, h).numpy()
            q = lq.query[b, h].double()
            k = lq.key_per_query_head[b, h].double()
            bk = _key_bias(lq, b, h)
            for m in range(n_valid):
                for n in range(n_valid):
                    if lq.causal and n > m:
                        continue
                    c = int(kcat[b, n])
                    pair_bias = float(q[m] @ bk[n])
                    for g, group in enumerate(QUERY_GROUPS_BY_ROLE):
                        if group == "all" or ROLE.index(group) == int(kcat[b, m]):
                            contrib[h, g, c] += Cb[m, n]
                            bias[h, g, c] += pair_bias
                            if h == 0:
                                pairs[g, c] += 1
                    weighted[h, c] += float(alpha[b, h, m, n]) * Cb[m, n]
                    weighted_bias[h, c] += float(alpha[b, h, m, n]) * pair_bias
                    qn[h, c] += float(q[m].norm()); kn[h, c] += float(k[n].norm())
                    cos[h, c] += float(q[m] @ k[n] / (q[m].norm() * k[n].norm()))
    return contrib, bias, pairs, weighted, weighted_bias, qn, kn, cos


@pytest.mark.parametrize("family", FAMILIES)
def test_factorised_aggregates_equal_brute_force(family, tiny_models):
    lm, layers, out = capture_layers(tiny_models[family], attn="eager")
    for lq in layers:
        stats = Contributions.zeros(len(layers), lq.n_heads, lq.x.shape[-1], QUERY_GROUPS_BY_ROLE)
        stats.add_layer(lq)
        geo = Geometry.zeros(len(layers), lq.n_heads)
        geo.add_layer(lq)
        dist = AttentionByDistance.zeros(len(layers), lq.n_heads, 16)
        dist.add_layer(lq)
        alpha = out.attentions[lq.layer].double()  # the model's own weights (eager)
        contrib, bias, pairs, weighted, weighted_bias, qn, kn, cos = _brute_force(lq, alpha)
        np.testing.assert_allclose(stats.contrib[lq.layer], contrib, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(stats.bias[lq.layer], bias, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(stats.weighted_bias[lq.layer], weighted_bias, rtol=1e-4, atol=1e-4)
        if lq.b_key is not None:
            assert np.abs(bias).max() > 1e-3  # the bias term is really exercised
        np.testing.assert_array_equal(stats.n_pairs[lq.layer], pairs)
        np.testing.assert_allclose(stats.weighted[lq.layer], weighted, rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(geo.n_pairs[lq.layer], pairs[0])
        np.testing.assert_allclose(geo.q_norm[lq.layer], qn, rtol=1e-5)
        np.testing.assert_allclose(geo.k_norm[lq.layer], kn, rtol=1e-5)
        np.testing.assert_allclose(geo.cos[lq.layer], cos, rtol=1e-4, atol=1e-5)
        # distance profile: explicit weights grouped by m - n
        T = alpha.shape[-1]
        valid = lq.valid.bool()
        for delta in range(-(T - 1), T):
            ref = 0.0
            for b in range(alpha.shape[0]):
                for m in range(T):
                    n = m - delta
                    if 0 <= n < T and valid[b, m] and valid[b, n] and (not lq.causal or n <= m):
                        ref += float(alpha[b, :, m, n].sum())
            assert abs(dist.attn[lq.layer].sum(0)[delta + 15] - ref) < 1e-5
        # masses per key category equal the explicit weights
        kcat = lq.key_onehot
        ref_mass = torch.einsum("bhmn,bnc,bm->hc", alpha, kcat, lq.valid.double()).numpy()
        np.testing.assert_allclose(geo.mass[lq.layer], ref_mass, rtol=1e-5, atol=1e-6)


def test_key_normalised_mass_equals_mass_when_keys_have_equal_norms(tiny_models):
    _, layers, _ = capture_layers(tiny_models["llama"])
    lq = layers[0]
    equal = LayerQK(0, lq.query, lq.key / lq.key.norm(dim=-1, keepdim=True) * 3.0, lq.scaling, lq.batch)  # equal norms
    geo = Geometry.zeros(1, lq.n_heads)
    geo.add_layer(equal)
    np.testing.assert_allclose(geo.mass_keynorm, geo.mass, rtol=1e-6)
    unequal = LayerQK(0, lq.query, equal.key * torch.linspace(0.2, 5.0, lq.key.shape[2])[None, None, :, None],
                      lq.scaling, lq.batch)
    geo2 = Geometry.zeros(1, lq.n_heads)
    geo2.add_layer(unequal)
    assert not np.allclose(geo2.mass_keynorm, geo2.mass, rtol=1e-3)


def test_stats_merge_halves_and_roundtrip(tiny_models):
    _, layers, _ = capture_layers(tiny_models["gpt_neox"])
    lq = layers[1]
    d = lq.x.shape[-1]
    whole = Contributions.zeros(2, lq.n_heads, d, QUERY_GROUPS_BY_ROLE)
    whole.add_layer(lq)
    halves = []
    for sl in (slice(0, 1), slice(1, 3)):
        part = lq.select(sl)
        c = Contributions.zeros(2, lq.n_heads, d, QUERY_GROUPS_BY_ROLE)
        c.add_layer(part)
        halves.append(c)
    merged = halves[1].merge(halves[0])
    np.testing.assert_allclose(merged.contrib, whole.contrib, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(merged.weighted, whole.weighted, rtol=1e-6, atol=1e-6)
    back = Contributions.from_arrow(whole.to_arrow())
    for f in ("contrib", "bias", "n_pairs", "weighted", "weighted_bias", "n_queries"):
        np.testing.assert_array_equal(getattr(back, f), getattr(whole, f))
    geo = Geometry.zeros(2, lq.n_heads)
    geo.add_layer(lq)
    g2 = Geometry.from_tables(geo.to_tables())
    for f in geo.__dataclass_fields__:
        np.testing.assert_array_equal(getattr(g2, f), getattr(geo, f))
    dist = AttentionByDistance.zeros(2, lq.n_heads, 16)
    dist.add_layer(lq)
    d2 = AttentionByDistance.from_tables(dist.to_tables())
    np.testing.assert_array_equal(d2.attn, dist.attn)
    np.testing.assert_array_equal(d2.pairs, dist.pairs)


def test_non_finite_tokens_are_counted_and_left_out(tiny_models):
    """An inf embedding: that token leaves layer 0's statistics; the NaN the model's own attention
    spreads from it (to its whole sequence: a NaN score poisons even masked-out rows) leaves
    layer 1's; every table stays finite."""
    from actlake.analysis.attention_mass import AttentionMass

    lm = load_model(ModelConfig(name_or_path=str(tiny_models["llama"])))
    capture.install(lm.model)
    mqk = ModelQK(lm.model, lm.family)
    poison = 7
    with torch.no_grad():
        lm.model.embed_tokens.weight[poison] = float("inf")
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(10, 300, (2, 10), generator=g)
    ids[0, 4] = poison
    valid = torch.ones(2, 10, dtype=torch.long)
    role = torch.randint(0, len(ROLE), (2, 10), generator=g)
    mass = AttentionMass.zeros(mqk.n_layers, mqk.n_heads)
    contrib = Contributions.zeros(mqk.n_layers, mqk.n_heads, lm.model.config.hidden_size)
    geo = Geometry.zeros(mqk.n_layers, mqk.n_heads)
    with capture.LayerInputs(lm.model, lm.family) as inputs:
        rec = AttentionRecorder(mqk, valid, one_hot(role, len(ROLE), valid),
                                [mass.add_layer, contrib.add_layer, geo.add_layer], inputs=inputs,
                                needs=mass.products, on_excluded=[mass.nonfinite_excluded])
        with torch.no_grad(), capture.recording(rec):
            lm.model(input_ids=ids, attention_mask=valid)
    assert mass.nonfinite.tolist() == [1, 10]  # layer 1: all of sequence 0
    for arr in (mass.mass, contrib.contrib, contrib.weighted, geo.cos, geo.q_norm, geo.mass_keynorm):
        assert np.isfinite(arr).all()
    np.testing.assert_allclose(mass.mass.sum((2, 3)), [[19] * mqk.n_heads, [10] * mqk.n_heads], rtol=1e-5)
    assert AttentionMass.from_arrow(mass.to_arrow()).nonfinite.tolist() == [1, 10]
