"""Rotary embeddings: the three-operation form against the textbook rotate_half form, on partial
rotary and on several vectors stacked per token."""

import torch

from actlake.analysis.engine.rope import apply, factors
from tests import rope_reference as reference
from tests.rope_reference import rotate_every_two, rotate_half


def rotate(y, cos, sin, interleaved: bool = False):
    """R_n y for each position n, the three-operation form."""
    return apply(y, factors(cos, sin, 1.0, interleaved))


def unrotate(y, cos, sin, interleaved: bool = False):
    """R_n^T y for each position n, the three-operation form."""
    return apply(y, factors(cos, sin, -1.0, interleaved))


def _cos_sin(B, T, rot, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    freqs = torch.rand(rot // 2, generator=g, dtype=dtype) + 0.1
    angles = torch.arange(T)[:, None] * freqs[None]  # (T, rot / 2)
    emb = torch.cat([angles, angles], -1)[None].expand(B, T, rot)  # as Hugging Face builds them
    return emb.cos(), emb.sin()


def test_rotation_equals_the_rotate_half_form_and_unrotation_inverts_it():
    B, H, T, dh, rot = 2, 3, 5, 8, 4  # partial rotary: the last 4 dims pass through
    y = torch.randn(B, H, T, dh, dtype=torch.float64)
    cos, sin = _cos_sin(B, T, rot, dtype=torch.float64)
    head = y[..., :rot]
    want = torch.cat([head * cos[:, None] + rotate_half(head) * sin[:, None], y[..., rot:]], -1)
    torch.testing.assert_close(rotate(y, cos, sin), want, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(unrotate(rotate(y, cos, sin), cos, sin), y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(unrotate(y, cos, sin), reference.unrotate(y, cos, sin), rtol=1e-14, atol=1e-14)


def test_stacked_vectors_rotate_each_like_one():
    B, H, T, k, dh = 2, 2, 6, 3, 8
    y = torch.randn(B, H, T, k, dh)
    cos, sin = _cos_sin(B, T, dh, seed=1)
    f = factors(cos, sin, -1.0)
    stacked = apply(y, f)
    for i in range(k):
        torch.testing.assert_close(stacked[..., i, :], unrotate(y[..., i, :], cos, sin), rtol=0, atol=0)


def test_interleaved_layout_equals_rotate_every_two_and_inverts():
    """GPT-J / Cohere: pairs (2i, 2i+1), angles repeated per pair."""
    B, H, T, dh, rot = 2, 3, 5, 8, 6
    y = torch.randn(B, H, T, dh, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    freqs = torch.rand(rot // 2, generator=g, dtype=torch.float64) + 0.1
    emb = (torch.arange(T)[:, None] * freqs[None]).repeat_interleave(2, -1)[None].expand(B, T, rot)
    cos, sin = emb.cos() * 1.3, emb.sin() * 1.3  # a scaled rotary: R is not orthogonal, R^T is its transpose
    head = y[..., :rot]
    want = torch.cat([head * cos[:, None] + rotate_every_two(head) * sin[:, None], y[..., rot:]], -1)
    torch.testing.assert_close(rotate(y, cos, sin, True), want, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(unrotate(y, cos, sin, True), reference.unrotate(y, cos, sin, True), rtol=1e-14, atol=1e-14)
    z = torch.randn_like(y)  # <R y, z> = <y, R^T z>
    torch.testing.assert_close((rotate(y, cos, sin, True) * z).sum(-1), (y * unrotate(z, cos, sin, True)).sum(-1))
    assert not torch.allclose(rotate(y, cos, sin, True), rotate(y, cos, sin, False))
