"""A family for a model type nobody declared, read off a weightless instance of the model (meta device).

The common layouts are recognised by module names (blocks at ``layers`` / ``h`` / ``decoder.layers`` /
``encoder.layer``, attention at ``self_attn`` / ``attn`` / ``attention``, keys from ``k_proj`` / ``key`` /
``k_lin`` or a stacked ``qkv_proj`` / ``Wqkv``, a ``k_norm`` or ``k_layernorm``, DeepSeek V3's latent attention), the RoPE layout and the output-logit transforms by
the modeling module's own source. What is found is announced, and each worker's first batch checks it against
the model's own numbers (:mod:`actlake.analysis.engine.selfcheck`): a wrong guess stops the job before anything
is written, so guessing never publishes a wrong number. Anything not recognised is refused, naming what is missing.
"""

from __future__ import annotations

import inspect
import sys

from actlake.architectures import NO_INTERFACE, Family, get_path
from actlake.errors import ModelLoadError

LAYERS = ("layers", "h", "decoder.layers", "encoder.layer", "transformer.h", "transformer.layer", "language_model.layers")
ATTENTION = ("self_attn", "attn", "attention.self", "attention", "self_attention")
KEYS = (("k_proj", "separate"), ("key", "separate"), ("k_lin", "separate"), ("qkv_proj", "stacked"),
        ("Wqkv", "stacked"))
KEY_NORMS = ("k_norm", "k_layernorm", "key_layernorm", "key_norm")
"""Names of a norm on k after the projection (q/k norm)."""
LATENT = ("kv_a_proj_with_mqa", "kv_b_proj", "kv_a_layernorm")
"""Multi-head latent attention as DeepSeek V3 names its modules: down-projection, up-projection, latent norm."""
LOGITS = (("final_logit_softcapping", "softcap"), ("logits_scaling", "divide"), ("logit_scale", "multiply"))
_found: dict = {}


def _find(obj, paths):
    for p in paths:
        try:
            return p, get_path(obj, p)
        except (AttributeError, IndexError, TypeError):
            continue
    return None, None


def discover(config) -> Family:
    """The family of an undeclared model type, or a one-line ModelLoadError naming what was not found."""
    t = config.model_type
    if t not in _found:
        _found[t] = _discover(config)
    return _found[t]


def _discover(config) -> Family:
    import torch
    from transformers import AutoModel
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    t = config.model_type
    refuse = lambda why: ModelLoadError(f"model_type {t!r} is not supported: it has no declaration, and {why} "
                                        "(docs/models.md)")
    if getattr(config, "is_encoder_decoder", False):
        raise refuse("encoder-decoder models (cross-attention) are not modelled")
    try:
        with torch.device("meta"):  # no memory, no weights
            model = AutoModel.from_config(config)
    except Exception as e:  # noqa: BLE001 - any model class may refuse a config
        raise refuse(f"its model could not be built to inspect ({type(e).__name__})") from None
    layers, blocks = _find(model, LAYERS)
    if not isinstance(blocks, torch.nn.ModuleList) or not len(blocks):
        raise refuse("no list of transformer blocks was found") from None
    found = [(p, m) for p, m in (_find(b, ATTENTION) for b in blocks) if m is not None]
    # a hybrid's first blocks may be linear-attention or recurrent ones, at the same path: the first module that
    # says whether it is causal (softmax attention modules do), else the first found
    attention, attn = next(((p, m) for p, m in found if getattr(m, "is_causal", None) is not None),
                           found[0] if found else (None, None))
    classes = {type(m).__name__ for _, m in found}
    if attn is None:
        raise refuse("no attention module was found in its blocks")
    source = inspect.getsource(sys.modules[type(attn).__module__])
    if "ALL_ATTENTION_FUNCTIONS" not in source:
        raise refuse(NO_INTERFACE)
    if "view_as_complex" in source:
        raise refuse("its RoPE is applied through complex numbers, which is not modelled yet")
    key = next(((name, layout) for name, layout in KEYS if hasattr(attn, name)), None)
    latent = all(hasattr(attn, n) for n in LATENT) and getattr(config, "kv_lora_rank", None)
    if latent:
        key = (LATENT[0], "separate")
    if key is None:
        raise refuse(f"no key projection was found in its attention module ({type(attn).__name__})")
    causal = getattr(attn, "is_causal", None)
    if causal is None:
        raise refuse("its attention module does not say whether it is causal")
    rope = _rope_layout(sys.modules[type(attn).__module__])
    head = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    head_source = inspect.getsource(sys.modules[head.__module__]) if head is not None else ""
    logits = tuple(f"{op}:{attr}" for attr, op in LOGITS if f"config.{attr}" in head_source or f"self.{attr}" in head_source)
    norm = LATENT[2] if latent else next((n for n in KEY_NORMS if hasattr(attn, n)), None)
    rope_layers = "no_rope_layers" if getattr(config, "no_rope_layers", None) else _rope_on_local_layers(type(attn))
    return Family(f"discovered:{t}", (t,), layers, attention, f"{attention}.{key[0]}", qkv=key[1], causal=bool(causal),
                  rope=rope, rope_layers=rope_layers,
                  key_norm=f"{attention}.{norm}" if norm else None,
                  latent=f"{attention}.{LATENT[1]}" if latent else None, logits=logits,
                  attention_class=type(attn).__name__ if len(classes) > 1 else None)


def _rope_layout(module) -> str | None:
    """``half`` / ``interleaved`` from the module's ``rotate_half``, None without rotary embeddings."""
    rotate = getattr(module, "rotate_half", None)
    if rotate is None:
        return None
    src = inspect.getsource(rotate)
    if "::2" not in src:
        return "half_negated" if "-x1" in src.replace(" ", "") else "half"
    apply = getattr(module, "apply_rotary_pos_emb", None)
    halved = apply is not None and "// 2].repeat_interleave(2" in inspect.getsource(apply)
    return "interleaved_half" if halved else "interleaved"


def _rope_on_local_layers(attention_class) -> str | None:
    """``sliding`` when the attention module applies RoPE under an ``if`` on its window (``sliding``, ``local``; not
    ``if not …``): RoPE on the sliding-window layers, none on the global ones (Cohere 2, AFMoE); ``sliding_or_all`` when
    that ``if`` also rotates every layer of a config without a window (``sliding_window is None or``: EXAONE 4);
    else None."""
    try:
        lines = [s.strip() for s in inspect.getsource(attention_class.forward).splitlines()]
    except (OSError, TypeError):
        return None
    for i, line in enumerate(lines):
        if "apply_rotary_pos_emb(" in line:
            tests = [s for s in lines[max(0, i - 3) : i] if s.startswith("if ") and not s.startswith("if not ")
                     and ("sliding" in s or "local" in s)]
            if not tests:
                return None
            return "sliding_or_all" if any("sliding_window is None or" in s for s in tests) else "sliding"
    return None


def describe(fam: Family) -> str:
    return (f"blocks at {fam.layers!r}, attention at {fam.attention!r}, keys from {fam.key!r} ({fam.qkv}), "
            f"{'causal' if fam.causal else 'bidirectional'}, RoPE {fam.rope or 'none'}"
            + (f", key norm {fam.key_norm!r}" if fam.key_norm else "")
            + (f", latent keys up-projected by {fam.latent!r}" if fam.latent else "")
            + (", RoPE on sliding-window layers only" if fam.rope_layers in ("sliding", "sliding_or_all") else "")
            + (f", attention in the blocks whose module is a {fam.attention_class}" if fam.attention_class else "")
            + (f", logits {', '.join(fam.logits)}" if fam.logits else ""))
