"""Architecture support, declared in one small place per family.

A family says where a layer's query/key projections live and what enters them
(x of METHODS.md: the layer input for post-LN BERT, the normalised input for
pre-LN models), whether attention is causal, and how positions enter q and k.
Attention itself is read through the transformers attention interface (see
``actlake.analysis.engine.capture``), so q and k are always the tensors the model uses.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from actlake.errors import ModelLoadError


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    """``config.model_type`` values this family covers."""
    layers: str
    """Dotted path from the base model to the list of transformer blocks."""
    attention: str
    """Dotted path from a block to the module that calls the attention interface."""
    qk_projections: tuple[str, ...]
    """Dotted paths from a block to the Q and K projections (one path when fused with V)."""
    causal: bool
    rotary: bool
    """Positions enter q and k by rotation (RoPE; partial for GPT-NeoX)."""


FAMILIES = (
    Family("bert", ("bert", "roberta", "xlm-roberta"), "encoder.layer", "attention.self",
           ("attention.self.query", "attention.self.key"), causal=False, rotary=False),
    Family("gpt2", ("gpt2",), "h", "attn", ("attn.c_attn",), causal=True, rotary=False),
    Family("gpt_neox", ("gpt_neox",), "layers", "attention", ("attention.query_key_value",), causal=True, rotary=True),
    Family("llama", ("llama", "mistral", "qwen2"), "layers", "self_attn",
           ("self_attn.q_proj", "self_attn.k_proj"), causal=True, rotary=True),
)


def family_for(model_type: str) -> Family:
    for fam in FAMILIES:
        if model_type in fam.model_types:
            return fam
    known = ", ".join(t for f in FAMILIES for t in f.model_types)
    raise ModelLoadError(f"model_type {model_type!r} is not supported yet (supported: {known})")


def get_path(obj, dotted: str):
    for part in dotted.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def blocks(base_model, family: Family):
    """The transformer blocks of a base model (``AutoModel``) or a model with a head."""
    for candidate in (base_model, getattr(base_model, "base_model", None)):
        try:
            return list(get_path(candidate, family.layers))
        except AttributeError:
            continue
    raise ModelLoadError(f"{family.name}: cannot find layers at '{family.layers}' in {type(base_model).__name__}")


def key_weights(block, family: Family, n_heads: int, n_kv_heads: int) -> tuple:
    """The key projection of one block as (W_K (H_kv, d, d_h), b_K (H_kv, d_h) or None), in float32.

    With these, k = x W_K + b_K per key head, where x is the input of ``family.qk_projections[-1]``.
    """
    mod = get_path(block, family.qk_projections[-1])
    with onloaded(mod):  # the tensors read here stay valid when an offloaded module goes back to meta
        w = mod.weight.detach().float()
        b = mod.bias.detach().float() if getattr(mod, "bias", None) is not None else None
    if family.name == "gpt2":  # Conv1D (d, 3d): columns [q | k | v]
        d = w.shape[0]
        w, b = w[:, d : 2 * d], (b[d : 2 * d] if b is not None else None)
        dh = d // n_heads
        return w.reshape(d, n_heads, dh).permute(1, 0, 2).contiguous(), (b.reshape(n_heads, dh) if b is not None else None)
    if family.name == "gpt_neox":  # Linear (3d, d): per head rows [q | k | v]
        d = w.shape[1]
        dh = d // n_heads
        wk = w.reshape(n_heads, 3, dh, d)[:, 1]  # (H, d_h, d)
        bk = b.reshape(n_heads, 3, dh)[:, 1] if b is not None else None
        return wk.transpose(1, 2).contiguous(), bk
    # separate Linear (H_kv * d_h, d)
    d = w.shape[1]
    dh = w.shape[0] // n_kv_heads
    wk = w.reshape(n_kv_heads, dh, d).transpose(1, 2).contiguous()
    return wk, (b.reshape(n_kv_heads, dh) if b is not None else None)


def onloaded(module):
    """Context in which ``module``'s parameters hold their values on the device the module runs on, also
    when accelerate offloaded them (``device_map`` with CPU or disk offload keeps them on the meta device
    outside the module's forward pass). A plain context for any other module."""
    hook = getattr(module, "_hf_hook", None)
    if hook is None or not getattr(hook, "offload", False):
        return contextlib.nullcontext()
    from accelerate.utils import align_module_device  # loads accelerate, torch: imported when used

    return align_module_device(module)


def key_input_module(block, family: Family):
    """The module whose input is x (the key projection, or the fused QKV projection)."""
    return get_path(block, family.qk_projections[-1])
