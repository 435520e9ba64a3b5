"""Turns each attention call of a forward pass into a :class:`LayerQK` for the analyses."""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable

import torch

from actlake.analysis.engine import rope as rope_
from actlake.analysis.engine.attention_weights import EXPLICIT_ONLY, flash_applies, padded_applies
from actlake.analysis.engine.capture import LayerInputs, attention_modules
from actlake.analysis.engine.device import tf32
from actlake.analysis.engine.layer_qk import BatchInfo, LayerQK
from actlake.analysis.engine.layer_replay import LayerReplay
from actlake.architectures import (attention_calls, blocks, clip_qkv, key_gain, key_shift, key_weights,
                                  latent_scaled_dims, query_heads, text_config)
from actlake.errors import AnalysisError, ModelLoadError


class ModelQK:
    """Per-model facts the recorder needs, computed once per worker."""

    def __init__(self, model, family):
        self.model, self.family = model, family
        cfg = self.config = text_config(model.config)  # a multimodal model's: its text model's
        self.n_heads = query_heads(cfg)  # an encoder-decoder model's: its decoder's
        self.n_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.layer_of = attention_modules(model, family)
        """``id(attention module) -> its block's index`` (the block whose weights, inputs and RoPE it reads)."""
        self._blocks = blocks(model, family)
        self.n_layers = len(self._blocks)
        self.attention_layers = sorted(self.layer_of.values())
        """Layers with attention: all of them but a hybrid's linear-attention, recurrent or state-space layers."""
        if not self.attention_layers:
            raise ModelLoadError(f"{family.name}: no block has an attention module at '{family.attention}'")
        self.calls = attention_calls(cfg)
        """Call-order layers (blocks run several times per forward pass): the attention calls a pass makes, each one
        layer (the k-th call is layer k), else None."""
        if self.calls is not None:
            self.n_layers, self.attention_layers = self.calls, list(range(self.calls))
        self.clip = clip_qkv(cfg)
        """Clipped keys (``clip_qkv``): each call's correction clamp(y) - y joins the bias term (:meth:`clip_shift`)."""
        self._weights: dict[int, tuple] = {}
        self._gains: dict[int, torch.Tensor | None] = {}
        self._shifts: dict[int, torch.Tensor | None] = {}
        self._scaled_dims: dict = {}

    def weights(self, layer: int, n_heads: int, n_kv_heads: int, head_dim: int) -> tuple:
        """(W_K (H_kv, d, d_h), b_K) in float32 of one block (``layer``: its index, :attr:`layer_of`), on its device
        (head counts and width: the kernel's); so are the other per-block reads below."""
        if layer not in self._weights:
            self._weights[layer] = key_weights(self._blocks[layer], self.family, self.config, n_heads, n_kv_heads,
                                               head_dim)
        return self._weights[layer]

    def key_gain(self, layer: int, n_kv_heads: int, head_dim: int) -> torch.Tensor | None:
        """(H_kv, d_h) float32 gain of a key norm after RoPE (``Family.key_norm_after_rope``) of one layer, or None."""
        if layer not in self._gains:
            self._gains[layer] = key_gain(self._blocks[layer], self.family, n_kv_heads, head_dim)
        return self._gains[layer]

    def key_shift(self, layer: int, n_kv_heads: int, head_dim: int) -> torch.Tensor | None:
        """(H_kv, d_h) float32 bias of a key LayerNorm of one layer (added after its 1 / r_n), or None."""
        if layer not in self._shifts:
            self._shifts[layer] = key_shift(self._blocks[layer], self.family, n_kv_heads, head_dim)
        return self._shifts[layer]

    def key_scale_dims(self, head_dim: int, device) -> torch.Tensor | None:
        """(d_h,) the dims of k its key norm scales (multi-head latent attention), or None: every dim."""
        if (head_dim, device) not in self._scaled_dims:
            dims = latent_scaled_dims(self.family, self.config, head_dim)
            self._scaled_dims[head_dim, device] = None if dims is None else dims.to(device)
        return self._scaled_dims[head_dim, device]

    def clip_shift(self, x: torch.Tensor, w_key: torch.Tensor, b_key) -> torch.Tensor:
        """(B, H_kv, T, d_h) float32 clamp(y, -c, c) - y for y = x W_K + b_K (k before RoPE is y plus it, exactly): the
        part of a clipped key no dimension of x owns."""
        y = torch.einsum("btd,hdk->bhtk", x.float(), w_key.to(x.device))
        if b_key is not None:
            y = y + b_key.to(x.device)[None, :, None]
        return y.clamp(-self.clip, self.clip) - y

    def rope_on(self, layer: int) -> bool:
        return self.family.rope_on(self.config, layer)


class AttentionRecorder:
    """Receives q and k from the attention wrapper; builds LayerQK and calls ``consumers``.

    ``valid`` (B, T) and ``role_onehot`` (B, T, C): the batch, preferably as host tensors (whatever
    steers Python code is computed from them, so no layer waits for the device).
    ``on_excluded``: called (layer, token count) when tokens leave a layer's statistics for inf/NaN.
    ``inputs``: active :class:`LayerInputs` when consumers need x / RoPE (contributions).
    ``needs``: products of the attention weights the consumers read (:mod:`attention_weights`), computed
    together once per layer. ``method``: ``explicit`` (weights in blocks), ``fused`` (one-hot V through
    the fused kernel when ``needs`` allows) or ``auto`` (fused on a GPU when ``needs`` allows, else explicit).
    When the weights are computed explicitly anyway (``explicit``, ``flash``), the model gets its attention
    output from them instead of running the SDPA kernel a second time (:attr:`replaced_layers`).
    ``triton``: on layers FlashAttention serves, the distance profile and the weighted sums from the
    Triton kernels (:mod:`~actlake.analysis.engine.kernels`).
    ``strict``: check each layer's mask and look for inf/NaN tokens as it comes (both read a value back
    from the device, once per layer). False: assume both are fine and count on the device what
    contradicts it (:meth:`problems`); the caller reads that once per batch and, if it is not zero,
    runs the batch again strictly. Statistics of a batch with problems are wrong and must be dropped.
    ``replay``: when not strict, the consumers' work of one layer is recorded and replayed at the others
    (:mod:`~actlake.analysis.engine.layer_replay`; ``consumers`` are then its analyses' ``add_layer``).
    """

    def __init__(self, mqk: ModelQK, valid: torch.Tensor, role_onehot: torch.Tensor,
                 consumers: list[Callable[[LayerQK], None]],
                 inputs: LayerInputs | None = None, needs=frozenset(), method: str = "auto",
                 strict: bool = True, on_excluded=(), triton: bool = False, replay: LayerReplay | None = None):
        self.mqk, self.consumers, self.inputs = mqk, consumers, inputs
        self.on_excluded = list(on_excluded)
        self.host = BatchInfo(valid.cpu(), mqk.family.causal, role_onehot.cpu(), role_onehot.cpu())
        self.needs = frozenset(needs)
        self.method, self.strict = method, strict
        self.triton = triton
        self._batch: dict = {}  # device -> BatchInfo (one per device with device_map)
        self._problems: dict = {}  # device -> (1,) float64: mismatched mask pairs
        self._totals: dict = {}  # device -> (3,) float32: sums of every layer's q, k and x (non-strict)
        self.replaced_layers = 0
        """Attention calls whose output came from the analyses' weights (the kernel did not run)."""
        self._rope = None  # (the model's cos, sin, what _rope_of made of them)
        self._checked_masks: list = []  # (mask, is_causal, BatchInfo) already compared (refs keep ids unique)
        self.replay = replay
        self._computed_on: set = set()  # devices where a layer of this batch ran as it is
        self.seen: set = set()  # attention layers recorded in this batch
        self._calls = 0  # attention calls so far in this forward pass (one recorder per pass)
        self._first: dict = {}  # block -> weak references to the q and k of its first call in this pass
        self._layer_of_call: dict = {}  # id(module) -> the layer its latest call recorded (kernel_output's)
        self.check = None
        """A :class:`~actlake.analysis.engine.selfcheck.SelfCheck` to feed (a worker's first batch), or None."""

    def problems(self) -> list[torch.Tensor]:
        """Per device, (4,) float64 on it: query-key pairs where the model's mask differed from the one the
        statistics assume, and whether the sums of q, k and x over all layers hold inf/NaN (then some
        layer did). Always zero when ``strict``."""
        return [torch.cat([self._problems[d], (~torch.isfinite(self._totals[d])).double()]) for d in self._problems]

    def on_attention(self, module, query, key, scaling, attention_mask=None, is_causal=None, value=None, softcap=None,
                     sliding_window=None, sinks=None):
        unit = self.mqk.layer_of.get(id(module))
        if unit is None:
            raise AnalysisError(f"an attention module of the model ({type(module).__name__}) called the attention "
                                f"interface outside the layers declared for {self.mqk.family.name!r} (blocks at "
                                f"{self.mqk.family.layers!r}, attention at {self.mqk.family.attention!r}): its attention "
                                "would be missing from every statistic; the model type needs a declaration")
        layer = self._call_layer(unit, module, query, key)
        if layer is None:  # the same q and k again (DiffLlama's second value): recorded at the first call
            return None
        dev = query.device  # with device_map, each layer's analyses run where that layer lives
        if dev not in self._batch:
            self._batch[dev] = self.host.to(dev)
            self._problems[dev] = torch.zeros(1, dtype=torch.float64, device=dev)
            self._totals[dev] = torch.zeros(3, dtype=torch.float32, device=dev)
        window = self._window(dev, sliding_window)
        self._check_mask(layer, self._batch[window], attention_mask, self.mqk.family.causal if is_causal is None else is_causal)
        t = {"query": query.detach(), "key": key.detach(), "value": value.detach() if value is not None else None,
             "x": None, "w_key": None, "b_key": None, "key_scale": None, "key_gain": None, "key_shift": None,
             "sinks": sinks.detach().float() if sinks is not None else None}
        rope = None
        if self.inputs is not None:  # per block (its weights, its inputs of this call)
            t["x"] = self.inputs.x.pop(unit).detach()  # not kept past its layer
            t["w_key"], t["b_key"] = self.mqk.weights(unit, query.shape[1], key.shape[1], key.shape[-1])
            t["key_scale"] = self.inputs.key_scale(unit, key)
            t["key_gain"] = self.mqk.key_gain(unit, key.shape[1], key.shape[-1])
            t["key_shift"] = self.mqk.key_shift(unit, key.shape[1], key.shape[-1])
            if self.mqk.clip is not None:  # a plain key path (check_clip): no shift of a norm to add it to
                t["key_shift"] = self.mqk.clip_shift(t["x"], t["w_key"], t["b_key"])
            rope = self.inputs.rope.get(unit) if self.mqk.rope_on(unit) else None
        self.seen.add(layer)
        softcap = None if softcap is None else float(softcap)
        if (self.replay is None or self.strict or softcap is not None or sinks is not None
                or self.mqk.clip is not None):  # a clip's correction is per call: no replay
            out = self._layer(layer, t, float(scaling), rope, self.consumers, softcap, window)
        else:
            out = self._replayed(layer, t, float(scaling), rope, window)
        self.replaced_layers += out is not None
        return out

    def _call_layer(self, unit: int, module, query, key) -> int | None:
        """The layer of this attention call: its block (``unit``), or the call's rank in the pass for call-order layers
        (raising when a pass makes more calls than the config declares); None for a block's second call with the very
        q and k of its first (only v differs: the same attention weights); raises for one with other q or k."""
        mqk, what = self.mqk, f"model_type {self.mqk.config.model_type!r}"
        if mqk.calls is not None:
            layer, self._calls = self._calls, self._calls + 1
            if layer >= mqk.calls:
                raise AnalysisError(f"{what}: its attention modules were called more than the {mqk.calls} times per "
                                    "forward pass its config declares (call-order layers: blocks run several times), "
                                    "so the layers would be misnumbered")
        elif unit in self._first:
            q, k = self._first[unit]
            if q() is query and k() is key:
                return None
            raise AnalysisError(f"{what}: attention layer {unit} called the attention kernel again in one forward pass "
                                "with other q or k, which the per-layer statistics (one attention per layer) do not "
                                "model (blocks run several times need their config to declare it: call-order layers)")
        else:
            layer = unit
            self._first[unit] = (weakref.ref(query), weakref.ref(key))
        self._layer_of_call[id(module)] = layer
        return layer

    def _window(self, dev, sliding_window) -> object:
        """The key of this layer's BatchInfo in ``_batch``: the device, or (device, W) for a sliding window W
        shorter than the batch's windows (its pairs are the ones the statistics count)."""
        if sliding_window is None or int(sliding_window) >= self.host.valid.shape[1]:
            return dev
        key = (dev, int(sliding_window))
        if key not in self._batch:
            self._batch[key] = self._batch[dev].windowed(int(sliding_window))
        return key

    def _replayed(self, layer: int, t: dict, scaling: float, rope, window):
        """:meth:`_layer` through :attr:`replay`: the batch's first layer as it is, the second recorded, the
        recording replayed from then on wherever the inputs fit it. Only layers on the analyses' device
        are recorded and replayed (with a device_map, the others run as they are)."""
        r, dev = self.replay, t["query"].device
        extra = (scaling, dev, window, None if rope is None else tuple(id(a) for a in rope))  # what the recording bakes in
        if r.static is None and dev in self._computed_on and dev == r.device:
            r.record(t, extra, lambda st, consumers: self._layer(0, st, scaling, rope, consumers, None, window),
                     keep=(rope, self._rope))  # the rotary tensors and their factors, cached by the first layer
        if r.fits(t, extra):
            return r.replay(layer, t)
        self._computed_on.add(dev)
        return self._layer(layer, t, scaling, rope, self.consumers, None, window)

    def _layer(self, layer: int, t: dict, scaling: float, rope, consumers, softcap: float | None = None,
               window=None):
        """Every analysis of one layer (``t``: its tensors as :meth:`on_attention` collects them); the
        attention output when it replaces the kernel's."""
        query, batch = t["query"], self._batch[window if window is not None else t["query"].device]
        f32 = lambda t: t.to(torch.float32).contiguous()  # blocks of q and k are read many times
        q, k = f32(query), f32(t["key"])
        x = f32(t["x"]) if t["x"] is not None else None
        any_bad = False
        if not self.strict:  # summed here (inf/NaN make the totals non-finite), read by the caller once per batch
            sums = [v.sum() for v in (q, k, x) if v is not None]
            totals = self._totals[query.device]
            torch._foreach_add_(list(totals[: len(sums)]), sums)
        else:
            bad = self._nonfinite_tokens(batch, q, k, x)  # (B, T) bool, or None when every value is finite
            any_bad = bad is not None and bool(bad.any())
        if any_bad:  # inf/NaN (e.g. fp16 overflow): those tokens leave this layer's statistics
            keep = (~bad).to(batch.key_onehot.dtype)
            batch = BatchInfo(batch.valid * (~bad), batch.causal, batch.key_onehot * keep[..., None],
                              batch.query_onehot * keep[..., None], batch.window)
            clean = lambda t: torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0)
            q, k, x = clean(q), clean(k), (clean(x) if x is not None else None)
            for tell in self.on_excluded:
                tell(layer, bad.sum())
        method = self.method
        if softcap is not None or batch.window is not None or t["sinks"] is not None:  # known to explicit weights only
            method = "explicit"
        if method == "auto" and not any_bad and flash_applies(query, batch):
            method = "flash"
        elif method == "auto" and not any_bad and self.triton and padded_applies(query, batch):
            method = "padded"
        elif method == "auto":
            method = "fused" if query.device.type == "cuda" and not self.needs & EXPLICIT_ONLY else "explicit"
        # the kernel's output can come from our weights only when they are the model's: no token left out
        value = t["value"]
        replace = value is not None and method in ("explicit", "flash") and bool(self.needs) and not any_bad
        lq = LayerQK(layer, q, k, scaling, batch, needs=self.needs | ({"output"} if replace else frozenset()),
                     method=method, value=f32(value) if replace and method == "explicit" else None,
                     native=(query, t["key"], value), triton=self.triton and method in ("flash", "padded"),
                     key_scale=t.get("key_scale"), key_gain=t.get("key_gain"),
                     key_shift=t.get("key_shift"), softcap=softcap, sinks=t["sinks"],
                     key_scale_dims=self.mqk.key_scale_dims(query.shape[-1], query.device))
        with tf32_when_exact(query):
            if self.inputs is not None:
                lq.x, lq.w_key, lq.b_key = x, t["w_key"], t["b_key"]
                if rope is not None:
                    lq.cos, lq.sin, lq.unrotation = self._rope_of(rope, query.shape[0], query.shape[2])
            if self.check is not None:
                self.check.layer(lq, t)
            for consume in consumers:
                consume(lq)
            return lq.product("output") if replace else None

    def _rope_of(self, rope: tuple, B: int, T: int) -> tuple:
        """(cos, sin, R^T factors) in float32 for the model's rotary (cos, sin); computed once while the
        layers receive the same tensors (models compute them once per forward pass)."""
        if self._rope is None or self._rope[0] is not rope[0] or self._rope[1] is not rope[1]:
            cos, sin, interleaved = rope_.from_model(self.mqk.family.rope, rope)
            cos, sin = (t.detach().float().expand(B, T, -1) for t in (cos, sin))
            self._rope = (rope[0], rope[1], (cos, sin, rope_.factors(cos, sin, -1.0, interleaved,
                                                                               self.mqk.family.latent is not None)))
        return self._rope[2]

    @staticmethod
    def _nonfinite_tokens(batch: BatchInfo, q, k, x) -> torch.Tensor | None:
        """Real tokens whose q, k or x hold inf/NaN. One sum per tensor first (inf and NaN survive it);
        the per-token test runs only when a sum is not finite."""
        if all(bool(torch.isfinite(t.sum())) for t in (q, k, x) if t is not None):
            return None
        finite = torch.isfinite(q).all(-1).all(1) & torch.isfinite(k).all(-1).all(1)  # (B, T)
        if x is not None:
            finite &= torch.isfinite(x).all(-1)
        return batch.valid.bool() & ~finite

    def kernel_output(self, module, value: torch.Tensor, output: torch.Tensor) -> None:
        """The attention output (B, T, H, d_h) the model's kernel computed, for the self-check."""
        if self.check is not None:
            self.check.kernel_output(self._layer_of_call[id(module)], value, output)

    def _check_mask(self, layer: int, batch: BatchInfo, attention_mask, is_causal: bool) -> None:
        """The pairs the model attends (on real queries) must be the pairs the statistics count. Strict:
        raise at once; else count the differing pairs on the device (the strict rerun raises)."""
        if any(m is attention_mask and c == is_causal and b is batch for m, c, b in self._checked_masks):
            return  # models build one mask per forward pass: compared at the first layer
        T = batch.valid.shape[1]
        if attention_mask is None:
            model = torch.ones(1, 1, T, T, dtype=torch.bool, device=batch.valid.device)
            model = model.tril() if is_causal else model
        elif attention_mask.dtype == torch.bool:
            model = attention_mask
        else:  # additive: 0 where attended, a large negative number elsewhere
            model = attention_mask > torch.finfo(attention_mask.dtype).min / 2
        model = model[..., -T:, -T:].to(batch.valid.device)
        differ = (model != batch.pair_mask).any(1) & batch.valid.bool()[:, :, None]  # (B, T, T) on real queries
        self._checked_masks.append((attention_mask, is_causal, batch))
        if not self.strict:
            self._problems[batch.valid.device][0] += differ.sum()
        elif bool(differ.any()):
            raise AnalysisError(
                f"attention layer {layer}: the model's attention mask differs from "
                f"{'causal + ' if batch.causal else ''}padding"
                f"{f' + a sliding window of {batch.window}' if batch.window else ''} on {int(differ.sum())} query-key "
                "pairs (a window or chunking the kernel was not told of?); the attention statistics would not describe "
                "what the model attends to")


def tf32_when_exact(query: torch.Tensor):
    """On a GPU, float32 products on tensor cores (TF32: 10-bit mantissa inputs, float32 accumulation)
    while the analyses of a bfloat16 / float16 model run: q, k and x of such a model are exact in TF32,
    and the attention weights are rounded to 2^-11 relative, below the model's own rounding. Float32
    models keep full float32 products."""
    if query.device.type != "cuda" or query.dtype not in (torch.bfloat16, torch.float16):
        return contextlib.nullcontext()
    return tf32(True)
