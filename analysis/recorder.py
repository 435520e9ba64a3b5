"""Turns each attention call of a forward pass into a :class:`LayerQK` for the analyses."""

from __future__ import annotations

from typing import Callable

import torch

from actlake.analysis.attention_mass import AttentionMass
from actlake.analysis.capture import LayerInputs, attention_modules
from actlake.analysis.layer_qk import BatchInfo, LayerQK
from actlake.architectures import blocks, key_weights


class ModelQK:
    """Per-model facts the recorder needs, computed once per worker."""

    def __init__(self, model, family):
        self.model, self.family = model, family
        cfg = model.config
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.layer_of = attention_modules(model, family)
        self.n_layers = len(self.layer_of)
        self._weights = None

    @property
    def weights(self) -> list[tuple]:
        """Per layer (W_K (H_kv, d, d_h), b_K) in float32, on the layer's device."""
        if self._weights is None:
            self._weights = [key_weights(b, self.family, self.n_heads, self.n_kv_heads) for b in blocks(self.model, self.family)]
        return self._weights


class AttentionRecorder:
    """Receives q and k from the attention wrapper; builds LayerQK and calls ``consumers``.

    ``mass``: attention mass per query and key category (one fused call with one-hot V).
    ``inputs``: active :class:`LayerInputs` when consumers need x / RoPE (contributions).
    """

    def __init__(self, mqk: ModelQK, valid: torch.Tensor, role_onehot: torch.Tensor,
                 consumers: list[Callable[[LayerQK], None]], mass: AttentionMass | None = None,
                 inputs: LayerInputs | None = None):
        self.mqk, self.valid, self.onehot = mqk, valid, role_onehot
        self.consumers, self.mass, self.inputs = consumers, mass, inputs
        self._batch: dict = {}  # device -> BatchInfo (one per device with device_map)

    def on_attention(self, module, query, key, scaling):
        layer = self.mqk.layer_of[id(module)]
        dev = query.device  # with device_map, each layer's analyses run where that layer lives
        if dev not in self._batch:
            oh = self.onehot.to(dev)
            self._batch[dev] = BatchInfo(self.valid.to(dev), self.mqk.family.causal, oh, oh)
        f32 = lambda t: t.detach().to(torch.float32).contiguous()
        q, k, batch = f32(query), f32(key), self._batch[dev]
        x = f32(self.inputs.x[layer]) if self.inputs is not None else None
        finite = torch.isfinite(q).all(-1).all(1) & torch.isfinite(k).all(-1).all(1)  # (B, T)
        if x is not None:
            finite &= torch.isfinite(x).all(-1)
        bad = batch.valid.bool() & ~finite
        if bad.any():  # inf/NaN (e.g. fp16 overflow): those tokens leave this layer's statistics
            keep = (~bad).to(batch.key_onehot.dtype)
            batch = BatchInfo(batch.valid * (~bad), batch.causal, batch.key_onehot * keep[..., None],
                              batch.query_onehot * keep[..., None])
            clean = lambda t: torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0)
            q, k, x = clean(q), clean(k), (clean(x) if x is not None else None)
        if self.mass is not None:
            self.mass.nonfinite[layer] += float(bad.sum())
        lq = LayerQK(layer, q, k, float(scaling), batch)
        if self.mass is not None:
            self.mass.add_layer(lq)
        if self.inputs is not None:
            lq.x = x
            lq.w_key, lq.b_key = self.mqk.weights[layer]
            rope = self.inputs.rope.get(layer)
            if rope is not None and self.mqk.family.rotary:
                B, T = query.shape[0], query.shape[2]
                lq.cos, lq.sin = (t.detach().float().expand(B, T, -1) for t in rope)
        for consume in self.consumers:
            consume(lq)
