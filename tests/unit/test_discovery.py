"""Discovery's and the key path's small readers, on synthetic modules (no transformers model is built)."""

from __future__ import annotations

import types

import pytest
import torch

from actlake.architectures import affine_map, check_config, norm_affine, norm_affine_shift
from actlake.discovery import _norm_after_rope
from actlake.errors import ModelLoadError


class _AfterRope(torch.nn.Module):  # HunYuan's order
    def forward(self, hidden_states, position_embeddings):
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)  # noqa: F821
        key_states = self.key_layernorm(key_states)
        return attention_interface(self, query_states, key_states)  # noqa: F821


class _BeforeRope(torch.nn.Module):  # Qwen 3's
    def forward(self, hidden_states, position_embeddings):
        key_states = self.k_norm(self.k_proj(hidden_states))
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)  # noqa: F821
        return attention_interface(self, query_states, key_states)  # noqa: F821


class _QueryRotatedFirst(torch.nn.Module):  # Gemma 4's: q rotated, then k normed and rotated
    def forward(self, hidden_states, position_embeddings):
        query_states = apply_rotary_pos_emb(query_states, cos, sin, unsqueeze_dim=2)  # noqa: F821
        key_states = self.k_norm(key_states)  # noqa: F821
        key_states = apply_rotary_pos_emb(key_states, cos, sin, unsqueeze_dim=2)
        return attention_interface(self, query_states, key_states)  # noqa: F821


@pytest.mark.parametrize("cls, norm, after", [(_AfterRope, "key_layernorm", True), (_BeforeRope, "k_norm", False),
                                              (_QueryRotatedFirst, "k_norm", False), (_AfterRope, "k_norm", False)])
def test_a_key_norm_after_rope_is_read_from_the_forward_order(cls, norm, after):
    assert _norm_after_rope(cls, norm) is after


def test_a_layernorm_bias_is_read_off_the_module():
    torch.manual_seed(0)
    ln = torch.nn.LayerNorm(8, eps=1e-5)
    with torch.no_grad():
        ln.weight.copy_(1 + 0.3 * torch.randn(8))
        ln.bias.copy_(0.3 * torch.randn(8))
    g, width, beta = norm_affine_shift(ln, 8)
    assert width == 8
    assert torch.allclose(g, ln.weight, atol=1e-6) and torch.allclose(beta, ln.bias, atol=1e-6)
    y = torch.randn(5, 8)
    r = (y.var(-1, unbiased=False, keepdim=True) + 1e-5).sqrt()
    assert torch.allclose(ln(y), g * (y - y.mean(-1, keepdim=True)) / r + beta, atol=1e-5)
    with pytest.raises(ModelLoadError, match="adds a bias"):  # where the caller does not model it
        norm_affine(ln, 8)


def test_an_affine_map_before_the_key_projection_is_probed_exactly():
    torch.manual_seed(0)

    class NoNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight, self.bias = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))

        def forward(self, x):
            return x * self.weight + self.bias
    pre = torch.nn.Sequential(torch.nn.Linear(6, 4), NoNorm())
    a, c = affine_map(pre, 6)
    x = torch.randn(3, 6)
    assert torch.allclose(pre(x), x @ a + c, atol=1e-6)
    with pytest.raises(ModelLoadError, match="is not affine in x"):
        affine_map(torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.LayerNorm(4)), 6)


@pytest.mark.parametrize("changes, refused", [
    ({}, None),
    ({"use_bottleneck_attention": True}, "use_bottleneck_attention: True"),
    ({"key_query_shared_bottleneck": False}, "key_query_shared_bottleneck: False"),
    ({"normalization_type": "layer_norm"}, "normalization_type: 'layer_norm'"),
])
def test_a_declared_family_refuses_configs_by_attribute_truth_falsity_or_value(changes, refused):
    config = types.SimpleNamespace(model_type="mobilebert", num_attention_heads=4, use_bottleneck=True,
                                   use_bottleneck_attention=False, key_query_shared_bottleneck=True,
                                   normalization_type="no_norm")
    vars(config).update(changes)
    if refused is None:
        assert check_config(config).name == "mobilebert"
    else:
        with pytest.raises(ModelLoadError, match=rf"'mobilebert' with {refused} is not supported"):
            check_config(config)
