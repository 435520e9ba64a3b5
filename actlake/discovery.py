"""A family for a model type nobody declared, read off a weightless instance of the model (meta device).

The common layouts are recognised by module names (blocks at ``layers`` / ``h`` / ``decoder.layers`` /
``encoder.layer``, attention at ``self_attn`` / ``attn`` / ``attention``, keys from ``k_proj`` / ``key`` /
``k_lin`` or a stacked ``qkv_proj`` / ``Wqkv``, a per-head ``query_key_value``, a ``[k | v]`` ``kv_proj``, a
``k_norm`` or ``k_layernorm``, DeepSeek V3's latent attention), the RoPE layout, whether the key norm comes after
RoPE, and the output-logit transforms by the modeling module's own source. Whether the attention goes through the
transformers attention interface at all is read from the model's modules (every modeling module its classes come
from, and the attention class's own ``forward``). An encoder-decoder model is read as its decoder, which a job runs
alone (the type's causal LM: no encoder input, no cross-attention; announced). What is found is announced, and each
worker's first batch checks it against the model's own numbers (:mod:`actlake.analysis.engine.selfcheck`): a wrong
guess stops the job before anything is written, so guessing never publishes a wrong number. Anything not recognised
is refused, naming what is missing.
"""

from __future__ import annotations

import inspect
import re
import sys

from actlake.architectures import NO_INTERFACE, Family, attention_calls, encoder_decoder, get_path, text_config
from actlake.errors import ModelLoadError

LAYERS = ("layers", "h", "decoder.layers", "encoder.layer", "transformer.h", "transformer.layer", "language_model.layers",
          "text_model.layers", "blocks")
ATTENTION = ("self_attn", "attn", "attention.self", "attention", "self_attention", "norm_attn_norm.attn", "mixer",
             "multi_head_attention", "temporal_block", "shared_transformer.self_attn")
KEYS = (("k_proj", "separate"), ("key", "separate"), ("k_lin", "separate"), ("qkv_proj", "stacked"),
        ("Wqkv", "stacked"), ("kv_proj", "kv"), ("Wk", "separate"), ("query_key_value", "per_head"))
KEY_NORMS = ("k_norm", "k_layernorm", "key_layernorm", "key_norm")
"""Names of a norm on k after the projection (q/k norm)."""
LATENT = ("kv_a_proj_with_mqa", "kv_b_proj", "kv_a_layernorm")
"""Multi-head latent attention as DeepSeek V3 names its modules: down-projection, up-projection, latent norm."""
LOGITS = (("final_logit_softcapping", "softcap"), ("logits_scaling", "divide"), ("logit_scale", "multiply"),
          ("logits_soft_cap", "softcap"))
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
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    t = config.model_type
    refuse = lambda why: ModelLoadError(f"model_type {t!r} is not supported: it has no declaration, and {why} "
                                        "(docs/models.md)")
    codebooks = _global(getattr(config, "decoder", None) or config, "num_codebooks")
    if encoder_decoder(config) and isinstance(codebooks, int) and codebooks > 1:
        raise refuse(f"its decoder reads num_codebooks {codebooks} parallel audio codebook tokens per position "
                     f"(input_ids of batch x {codebooks} rows) and predicts each, which the per-token statistics and "
                     "surprisal (one text token per position) do not model")
    if getattr(config, "languages", None) and not getattr(config, "default_language", None):
        raise refuse("its language adapters need a language and the config sets no default_language (set one in "
                     "its config.json)")
    try:
        model = _weightless(config)
    except Exception as e:  # noqa: BLE001 - any model class may refuse a config
        raise refuse(f"its model could not be built to inspect ({type(e).__name__}: {_first_line(e)})") from None
    _interface_anywhere(model, refuse)
    layers, blocks = _find(model, LAYERS)
    if not isinstance(blocks, torch.nn.ModuleList) or not len(blocks):
        stacks = _stacks(model)
        if len(stacks) > 1 and attention_calls(config) is not None:  # call-order layers: the blocks of every stack
            layers, blocks = "+".join(stacks), [b for p in stacks for b in get_path(model, p)]
        elif len(stacks) > 1:
            raise refuse(f"its transformer blocks are in {len(stacks)} stacks ({', '.join(stacks[:3])}), which the "
                         "per-layer statistics (one stack of blocks over the tokens) do not model")
        else:
            raise refuse("no list of transformer blocks was found") from None
    text_layers = _text_lm_layers(config)
    if text_layers and text_layers != layers:  # a job with surprisal loads the causal LM: the text model's blocks
        layers = f"{layers}|{text_layers}"
    found = [(p, m) for p, m in (_find(b, ATTENTION) for b in blocks) if m is not None]
    # a hybrid's first blocks may be linear-attention or recurrent ones, at the same path: the first module that
    # says whether it is causal (softmax attention modules do), else the first found
    attention, attn = next(((p, m) for p, m in found if getattr(m, "is_causal", None) is not None),
                           found[0] if found else (None, None))
    classes = {type(m).__name__ for _, m in found}
    if len({id(m) for _, m in found}) < len(found):
        raise refuse("one attention module is shared by several blocks (a shared transformer block), which the "
                     "per-layer statistics (one attention module per layer) do not model yet")
    if attn is None:
        raise refuse("no attention module was found in its blocks")
    source = inspect.getsource(sys.modules[type(attn).__module__])
    forward = _source(type(attn).forward)
    if "ALL_ATTENTION_FUNCTIONS" not in source or (forward and "ALL_ATTENTION_FUNCTIONS" not in forward
                                                    and "attention_interface" not in forward):
        raise refuse(NO_INTERFACE)  # its module's other classes may use it (Git's vision tower), not this one
    if "view_as_complex" in source:
        raise refuse("its RoPE is applied through complex numbers, which is not modelled yet")
    key = next(((name, layout) for name, layout in KEYS if hasattr(attn, name)), None)
    latent = all(hasattr(attn, n) for n in LATENT) and _global(config, "kv_lora_rank")
    if latent:
        key = (LATENT[0], "separate")
    if key is None:
        raise refuse(f"no key projection was found in its attention module ({type(attn).__name__})")
    conv = next((n for n, _ in attn.named_children() if "conv" in n.lower()), None)
    if conv:
        raise refuse(f"its attention module has a convolution over positions ({conv}): k is not made from its own "
                     "token's x alone, which the contributions do not model")
    proj = getattr(attn, key[0])
    inner = getattr(proj, "linear", None)  # a wrapper around one linear layer and nothing else (Moshi's MoshiLinear,
    if (getattr(proj, "weight", None) is None and isinstance(inner, torch.nn.Linear)  # not flexible)
            and list(proj.children()) == [inner] and not list(proj.parameters(recurse=False))):
        key, proj = (f"{key[0]}.linear", key[1]), inner
    if not isinstance(getattr(proj, "weight", None), torch.Tensor) or proj.weight.dim() != 2:
        raise refuse(f"its key projection ({type(proj).__name__}) has no single weight matrix (per-codebook or "
                     "otherwise split weights are not modelled)")
    width = _global(config, "hidden_size")
    if isinstance(width, int) and proj.weight.shape[1] != width:
        raise refuse(f"its key projection reads a {proj.weight.shape[1]}-wide input, not the {width}-wide residual "
                     "stream (a bottleneck, or the stream joined with another input), which the contributions (per "
                     "residual dimension) do not model")
    causal = getattr(attn, "is_causal", None)
    if encoder_decoder(config):  # a decoder's self-attention (BigBird-Pegasus's says is_causal False and is handed a
        causal = True  # causal mask); the recorder compares the mask the model hands its kernel on every batch
    if causal is None:
        causal = _causal_by_head(config)
    if causal is None:
        raise refuse("its attention module does not say whether it is causal")
    rope = _rope_layout(sys.modules[type(attn).__module__])
    if rope is None and hasattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb_interleave"):
        if not latent:  # pairs (2i, 2i + 1) returned in rotate-half order: folded into W_rot for latent keys only
            raise refuse("its RoPE de-interleaves the rotary pairs (apply_rotary_pos_emb_interleave) outside multi-head "
                         "latent attention, which is not modelled yet")
        rope = "half"
    head = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    head_source = _source(head.forward) if head is not None else ""  # its own forward: where it makes the logits
    logits = tuple(f"{_logit_op(head_source, attr, op)}:{attr}" for attr, op in LOGITS
                   if re.search(rf"\.{attr}\b", head_source))  # config.x, self.x, get_text_config().x
    norm = LATENT[2] if latent else next((n for n in KEY_NORMS if hasattr(attn, n)), None)
    after = bool(norm and not latent and rope and _norm_after_rope(type(attn), norm))
    if norm and isinstance(getattr(getattr(attn, norm), "bias", None), torch.Tensor) and (latent or after):
        raise refuse(f"its key norm ({type(getattr(attn, norm)).__name__}) adds a bias "
                     f"{'to the latent' if latent else 'after RoPE'}, which the contributions do not model yet")
    rope_layers = "no_rope_layers" if _global(config, "no_rope_layers") else _rope_on_local_layers(type(attn))
    return Family(f"discovered:{t}", (t,), layers, attention, f"{attention}.{key[0]}", qkv=key[1], causal=bool(causal),
                  rope=rope, rope_layers=rope_layers,
                  key_norm=f"{attention}.{norm}" if norm else None,
                  key_norm_after_rope=after,
                  latent=f"{attention}.{LATENT[1]}" if latent else None, logits=logits,
                  attention_class=type(attn).__name__ if len(classes) > 1 else None,
                  decoder_alone=encoder_decoder(config))


def _interface_anywhere(model, refuse) -> None:
    """Refused when no modeling module of the model's classes uses the transformers attention interface: attention
    computed by hand (older modeling files: XLM, XLNet, Reformer, Perceiver, SqueezeBERT, CPM-Ant), or no attention
    at all (no class of the model is an attention module: FNet's Fourier mixing, xLSTM)."""
    modules = {type(m).__module__ for m in model.modules()}
    if any("ALL_ATTENTION_FUNCTIONS" in _module_source(name) for name in modules):
        return
    if not any("attention" in type(m).__name__.lower() for m in model.modules()):
        raise refuse("no attention module was found in the model (none of its classes is one: it mixes tokens "
                     "without attention)")
    raise refuse(NO_INTERFACE)


def _module_source(name: str) -> str:
    try:
        return inspect.getsource(sys.modules[name])
    except (KeyError, OSError, TypeError):
        return ""


def _stacks(model) -> list[str]:
    """Paths of the lists of blocks that hold an attention module (a module whose class name says attention)."""
    import torch

    found = []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) and not any(name.startswith(f + ".") for f in found) and any(
                "attention" in type(x).__name__.lower() for x in m[0].modules()):
            found.append(name)
    return found


def _text_lm_layers(config) -> str | None:
    """Where the blocks are in the base of the type's causal LM when that class is built on its text config (Llama 4,
    Qwen 3.5, Mllama: the multimodal checkpoint loads as its text model there), else None."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    head = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if head is None or getattr(head, "config_class", type(config)) is type(config):
        return None
    try:
        with torch.device("meta"):
            lm = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - any model class may refuse a config
        return None
    return _find(_base(lm), LAYERS)[0]


def _causal_by_head(config) -> bool | None:
    """Causal where the type has a causal-LM head and no masked-LM one, bidirectional where it has only a masked-LM
    head; None (unknown) with both or neither. A wrong guess cannot pass: the mask the model hands its kernel is
    compared with causal + padding on every batch (the recorder's mask check)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_MASKED_LM_MAPPING

    lm = type(config) in MODEL_FOR_CAUSAL_LM_MAPPING, type(config) in MODEL_FOR_MASKED_LM_MAPPING
    return {(True, False): True, (False, True): False}.get(lm)


def _global(config, name: str):
    """``config.name`` or None; for a heterogeneous config (``per_layer_config``) its global value, which reading the
    attribute refuses when layers override it."""
    read = getattr(config, "_getattr_without_heterogeneous_validation", None)
    return read(name, None) if read is not None else getattr(config, name, None)


def _weightless(config):
    """The model of ``config`` on the meta device (no memory, no weights): its base model (``AutoModel``), or the base
    of its causal or masked LM where the type has no base-model class (TrOCR's decoder, a drafter model)."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM

    errors = []
    for auto in (AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM):
        try:
            with torch.device("meta"):
                model = auto.from_config(config)
        except ValueError as e:  # no such class for this config: the next kind
            errors.append(e)
            continue
        return model if auto is AutoModel else _base(model)
    raise errors[0]


def _base(model):
    base = getattr(model, "base_model", model)
    return getattr(model, "model", model) if base is model else base


def _first_line(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:120] if lines else ""


def _source(fn) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def _logit_op(source: str, attr: str, default: str) -> str:
    """How the head's source applies ``attr`` to the logits: ``divide`` / ``multiply`` where a line reads ``/ …attr`` or
    ``* …attr`` (HyperCLOVA X multiplies by the ``logits_scaling`` Granite divides by), else ``default``."""
    if default == "softcap":
        return default
    for line in source.splitlines():
        if attr in line and "logits" in line:
            squeezed = line.replace(" ", "")
            for ref in (f"self.config.{attr}", f"config.{attr}", f"self.{attr}", f"get_text_config().{attr}"):
                if f"/{ref}" in squeezed:
                    return "divide"
                if f"*{ref}" in squeezed:
                    return "multiply"
    return default


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


def _norm_after_rope(attention_class, norm: str) -> bool:
    """Whether the attention module's ``forward`` calls its key norm ``self.<norm>(`` after the RoPE call that rotates
    the keys (a line calling ``apply_rotary_pos_emb(`` with ``key`` in it: HunYuan), not before (most q/k-norm models;
    Gemma 4 rotates q first, then norms and rotates k)."""
    try:
        lines = inspect.getsource(attention_class.forward).splitlines()
    except (OSError, TypeError):
        return False
    normed = next((i for i, s in enumerate(lines) if f"self.{norm}(" in s), None)
    rotated = [i for i, s in enumerate(lines) if "apply_rotary_pos_emb" in s and "(" in s and "key" in s]
    return normed is not None and bool(rotated) and all(i < normed for i in rotated)


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
            + (" after RoPE (its gain on the query side)" if fam.key_norm_after_rope else "")
            + (f", latent keys up-projected by {fam.latent!r}" if fam.latent else "")
            + (", RoPE on sliding-window layers only" if fam.rope_layers in ("sliding", "sliding_or_all") else "")
            + (f", attention in the blocks whose module is a {fam.attention_class}" if fam.attention_class else "")
            + (f", logits {', '.join(fam.logits)}" if fam.logits else "")
            + (", the decoder of an encoder-decoder model, run alone" if fam.decoder_alone else ""))
