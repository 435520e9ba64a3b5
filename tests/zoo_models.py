"""Tiny random Hugging Face models of any model type, saved with ``save_pretrained`` and loaded back through
the real ``from_pretrained`` path (no downloads): a type's default config scaled down (hidden 64, 2 layers,
4 heads, 2 key/value heads, head width 16), its scaling knobs set away from their defaults, q/k weights
multiplied by 8 so attention is far from uniform (the largest weight of a query 0.34-0.46 over 12-24 keys, where
x4 gave 0.12-0.16; q/k-normed and softcapped models stay where their norm or cap puts them), norm gains and biases randomised, the output embedding multiplied
so logits span several units (where caps and scales change surprisal)."""

from __future__ import annotations

from pathlib import Path

import torch

CAUSAL = ("llama", "mistral", "ministral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
          "gemma3_text", "olmo", "olmo2", "olmoe", "phi", "phi3", "stablelm", "starcoder2", "cohere", "granite", "gptj",
          "gpt_bigcode", "opt", "smollm3", "gpt2", "gpt_neox", "gpt_oss", "deepseek_v3", "cohere2",
          "exaone4", "llama4_text", "llama4", "codegen", "deepseek_v2")
"""Causal LM types that run exactly (tests/integration/test_families.py)."""
ENCODERS = ("bert", "roberta", "xlm-roberta", "distilbert", "electra", "modernbert", "mobilebert")
REFUSED = ("gpt_neo", "falcon", "bloom", "deberta-v2")
"""Types refused before Ray, each with its reason (actlake/architectures.py)."""

SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             head_dim=16, n_embd=64, n_layer=2, n_head=4, n_inner=128, rotary_dim=8, dim=64, n_layers=2, n_heads=4,
             hidden_dim=128, ffn_dim=128, word_embed_proj_dim=64, vocab_size=512, max_position_embeddings=512,
             n_positions=512, pad_token_id=1, bos_token_id=0, eos_token_id=0, moe_intermediate_size=32, num_experts=4,
             num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=32,
             global_attn_every_n_layers=2, local_attention=512, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
             qk_nope_head_dim=8, v_head_dim=16, first_k_dense_replace=0, n_group=1, topk_group=1, num_layers=2,
             max_window_layers=2, sliding_window=512, sep_token_id=2, cls_token_id=0, axial_pos_shape=[16, 32],
             axial_pos_embds_dim=[32, 32], intra_bottleneck_size=16, mamba_n_heads=4,
             mamba_d_head=32, mamba_d_state=16, mamba_d_ssm=128)
KNOBS = dict(attn_logit_softcapping=2.0, final_logit_softcapping=3.0, logit_scale=0.5, logits_scaling=2.5,
             embedding_multiplier=3.0, residual_multiplier=0.7, attention_multiplier=0.3, query_pre_attn_scalar=24,
             partial_rotary_factor=0.5, floor_scale=4, attn_scale=0.5)
"""Scaling knobs away from their defaults, where a config has them (RoPE bases live in ``rope_parameters`` in
transformers 5: not set here)."""
SCALED = ("q_proj", "k_proj", "query", "key", "qkv", "c_attn", "Wqkv", "query_key_value", "q_lin", "k_lin",
          "kv_a_proj_with_mqa", "kv_b_proj", "q_b_proj",  # latent attention: the rotary key, the latent key, q
          "kv_proj")  # JetMoE: [k | v]


def tiny_config(model_type: str, knobs: bool = True, **overrides):
    """``model_type``'s default config scaled down: :data:`SIZES` and :data:`KNOBS` where it has them; two layers kept
    from the full stack (:func:`kept_layers`: a hybrid's or local/global model's two kinds), with every per-layer list
    and ``per_layer_config`` entry taken from those layers; sub-configs (a multimodal model's text, vision and audio
    towers) scaled the same way; a few defaults transformers itself cannot build fixed (:func:`_repair`)."""
    from transformers import AutoConfig

    try:
        c = AutoConfig.for_model(model_type)
    except (KeyError, ValueError) as e:
        raise ValueError(f"{model_type}: unknown to this transformers ({e})") from None
    _repair(c)
    pairs = ENCODER_DECODER if getattr(type(c), "is_encoder_decoder", False) else {}
    _scale(c, {**SIZES, **pairs, **(KNOBS if knobs else {})}, {**TYPE_SIZES.get(model_type, {}), **overrides})
    return c


def _fill(c) -> None:
    """:data:`REPAIRS` where the default leaves them None (after scaling: they are sizes of the tiny model)."""
    d = c.to_dict()
    for k, v in REPAIRS.items():
        if k in d and d[k] is None and _settable(c, k):
            setattr(c, k, v)
    nope, rot = d.get("qk_nope_head_dim"), d.get("qk_rope_head_dim")
    if isinstance(d.get("qk_head_dim"), int) and isinstance(nope, int) and isinstance(rot, int):
        c.qk_head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim  # derived, not a size of its own


def _settable(c, k: str) -> bool:
    prop = getattr(type(c), k, None)
    return not isinstance(prop, property) or prop.fset is not None


def kept_layers(types: list) -> list[int]:
    """Indices of the two layers of a full stack the tiny model keeps: the first of a layer kind other than full
    attention (a hybrid's linear or recurrent layers, a local/global model's sliding ones, another sparse kind), then
    the first full-attention one; the first two layers where the stack has one kind (or no ``layer_types``)."""
    if not types:
        return [0, 1]
    full = next((i for i, t in enumerate(types) if "full" in str(t)), None)
    kinds = list(dict.fromkeys(types))
    if full is None:  # no full-attention kind: the first layer of each of the first two kinds
        return [types.index(kinds[0]), types.index(kinds[1])] if len(kinds) > 1 else [0, 1]
    other = next((i for i, t in enumerate(types) if t != types[full]), None)
    return [other, full] if other is not None else [0, 1]


def _scale(c, sizes: dict, overrides: dict) -> None:
    d = c.to_dict()
    have = set(d) | set(getattr(c, "attribute_map", {}))
    n_layers = getattr(c, "num_hidden_layers", None)
    types = list(getattr(c, "layer_types", None) or [])
    keep = kept_layers(types) if n_layers and len(types) == n_layers else [0, 1]
    per_layer = d.get("per_layer_config") or {}
    globals_ = getattr(c, "_getattr_without_heterogeneous_validation", lambda k, default: d.get(k, default))
    defaults = {k: globals_(k, None) for k in {k for o in per_layer.values() for k in o}}
    have |= {k for k, v in defaults.items() if v is not None}  # per-layer attributes: left out of to_dict
    if per_layer:
        c.per_layer_config = None  # dropped before the sizes change (they are validated against num_hidden_layers)
    for k, v in {**sizes, **overrides}.items():
        if (k in have or k in overrides) and _settable(c, k):
            setattr(c, k, v)
    for k, v in d.items():  # a size named after one of SIZES (swa_num_attention_heads, index_head_dim): in proportion
        base = _base_size(k, sizes)
        if base and k not in overrides and _settable(c, k) and isinstance(v, int) and not isinstance(v, bool):
            setattr(c, k, _scaled(base, v, d.get(base), sizes))
    for k in SHRINK:  # counts the model caps (one expert per token): never above the default
        if isinstance(d.get(k), int) and k not in overrides and d[k] < getattr(c, k):
            setattr(c, k, d[k])
    for k in TIED:  # widths the model needs equal to the hidden size where the default has them equal
        if k in d and k not in overrides and d[k] == d.get("hidden_size") and "hidden_size" in sizes:
            setattr(c, k, sizes["hidden_size"])
    if getattr(c, "num_kv_shared_layers", None) and "num_kv_shared_layers" not in overrides:
        c.num_kv_shared_layers = 0  # layers reusing an earlier layer's k/v (Gemma 3n): none of two layers
    for k, v in d.items():  # per-layer lists (layer kinds, MoE layer kinds, heads per layer): the kept layers'
        if (isinstance(v, list) and n_layers and len(v) == n_layers and n_layers > 2 and k not in overrides
                and _settable(c, k)):
            base = _base_size(k, sizes)
            setattr(c, k, [_scaled(base, v[i], d.get(base), sizes) if base else v[i] for i in keep])
    _hybrid_layers(c, d, n_layers, overrides)
    if (isinstance(getattr(c, "rope_parameters", None), dict) and not c.rope_parameters and types
            and "rope_parameters" not in overrides):  # RoPE per layer kind that the default leaves empty
        c.rope_parameters = {t: {"rope_type": "default", "rope_theta": 10000.0} for t in dict.fromkeys(c.layer_types)}
    if getattr(c, "no_rope_layers", None) is not None:
        c.no_rope_layers = [1, 0]
    if globals_("kv_lora_rank", None) and "head_dim" not in overrides:  # latent attention: one key per head,
        c.head_dim, c.num_key_value_heads = c.qk_rope_head_dim, c.num_attention_heads  # rotary as wide as its dims
    if per_layer and "per_layer_config" not in overrides:  # a heterogeneous model: the kept layers' overrides
        kept = {}
        for j, i in enumerate(keep):
            o = per_layer.get(str(i).zfill(len(next(iter(per_layer)))), per_layer.get(str(i)))
            if o:
                kept[j] = {k: _scaled(k, v, defaults.get(k), sizes) for k, v in o.items()}
        if kept:
            c.per_layer_config = kept
    _fill(c)
    for name in getattr(c, "sub_configs", None) or {}:  # a multimodal model's towers
        sub = getattr(c, name, None)
        if sub is not None and hasattr(sub, "to_dict") and name not in overrides:
            _repair(sub)
            _scale(sub, sizes, {})


def _hybrid_layers(c, d: dict, n_layers, overrides: dict) -> None:
    """A hybrid's layer kinds in two layers, where they are not a per-layer list: an attention layer after a recurrent
    one by period and offset (Jamba, Zamba: ``attn_layer_period`` 8, offset 4 has none in two layers), by indices
    (Bamba: none by default), by a repeating pattern (RecurrentGemma's ``block_types``), or a default of recurrent
    layers only (Granite 4 hybrid's ``layer_types``: one made full attention)."""
    for k in d:
        if k.endswith("_layer_period") and k not in overrides and d.get(k[: -len("period")] + "offset") is not None:
            setattr(c, k, 2)
            setattr(c, k[: -len("period")] + "offset", 1)
    if "attn_layer_indices" in d and d["attn_layer_indices"] is None and "attn_layer_indices" not in overrides:
        c.attn_layer_indices = [1]
    for k, v in d.items():  # a repeating pattern of kinds shorter than the stack: one of each kind
        if (isinstance(v, list) and n_layers and 2 < len(v) < n_layers and all(isinstance(t, str) for t in v)
                and any("attention" in t for t in v) and k not in overrides and _settable(c, k)):
            attn = next(t for t in v if "attention" in t)
            c.__setattr__(k, [next((t for t in v if t != attn), attn), attn])
    types = getattr(c, "layer_types", None)
    if (types and all(t == "linear_attention" for t in types) and "layer_types" not in overrides
            and _settable(c, "layer_types")):
        c.layer_types = ["linear_attention", "full_attention"]


def _base_size(k: str, sizes: dict) -> str | None:
    """The key of :data:`SIZES` that ``k`` (not itself one) is a variant of: it starts or ends with it
    (``num_attention_heads_per_layer``, ``swa_head_dim``), the longest such; None for any other attribute."""
    if k in sizes:
        return None
    found = [s for s in sizes if len(s) >= 7 and s in SCALED_SIZES and (k.startswith(s + "_") or k.endswith("_" + s))]
    return max(found, key=len) if found else None


def _scaled(k: str, v, default, sizes: dict):
    """A per-layer override ``v`` of ``k`` in the tiny model: as much larger or smaller than :data:`SIZES`' value as it
    is than the full config's global value (a global layer's wider heads stay wider), else as it is."""
    if (k in sizes and isinstance(v, int) and isinstance(default, int) and default > 0 and isinstance(sizes[k], int)
            and not isinstance(v, bool)):
        return max(1, sizes[k] * v // default)
    return v


ENCODER_DECODER = dict(encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                       num_encoder_attention_heads=4, num_decoder_attention_heads=4, num_encoder_layers=2,
                       num_decoder_layers=2, encoder_ffn_dim=128, decoder_ffn_dim=128, d_model=64,
                       max_target_positions=512, max_source_positions=512)
"""An encoder-decoder model's sizes per side (BART, Whisper; their decoder runs alone as the type's causal LM)."""
TYPE_SIZES = {"esmc": {"num_key_value_heads": 4},
              "dory": {"n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 0,  # 3 calls of 2 blocks
                       "layer_types": ["sliding_attention", "full_attention"]},  # its to_dict doubles the list
              "hrm_text": {"num_layers_per_stack": 1, "L_cycles": 1, "num_hidden_layers": 4}}  # 4 calls of 2 blocks
"""The few types whose own validation refuses :data:`SIZES` (ESMC has no grouped-query attention) or whose repeated
blocks need a layout of two blocks (Dory's input and recurrent sections, HRM's one block per stack)."""
SCALED_SIZES = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "head_dim",
                "vocab_size", "moe_intermediate_size", "kv_lora_rank", "q_lora_rank")
"""Sizes whose variants (another attribute starting or ending with the name) are scaled in proportion."""
SHRINK = ("num_experts_per_tok",)
"""Counts kept at the default where it is smaller than :data:`SIZES`' (ZAYA takes one expert per token only)."""
TIED = ("embedding_size",)
"""Widths that stay equal to ``hidden_size`` where the default config has them equal (SqueezeBERT's embeddings)."""
REPAIRS = {"n_shared_experts": 1, "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16,
           "indexer_budget": 32, "indexer_compress_ratio": 4, "rope_theta": 10000.0, "vocabulary_map": {},
           "architectures": []}
"""Attributes some default configs leave None that their own models read (as sizes of the tiny model): filled where
None."""


def _repair(c) -> None:
    """Defaults transformers' own model classes cannot build from (None where a number is read, no ``rope_theta`` in
    DBRX's attention config, LFM2-MoE without ``layer_types``)."""
    d = c.to_dict()
    if type(c).__name__ == "DbrxAttentionConfig":  # DBRX clamps q/k/v by clip_qkv whether set or not
        c.rope_theta = getattr(c, "rope_theta", 10000.0)
        c.clip_qkv = c.clip_qkv or 8.0
    if d.get("languages") and d.get("default_language") is None and _settable(c, "default_language"):
        c.default_language = d["languages"][0]  # X-MOD: the language adapter a plain forward pass uses
    if "layer_types" in d and d["layer_types"] is None and hasattr(c, "num_dense_layers"):  # LFM2: conv / attention
        n = c.num_hidden_layers
        c.layer_types = ["full_attention" if i % 4 == 3 else "conv" for i in range(n)]


def build(model_type: str, out: Path, knobs: bool = True, scale: float = 8.0, seed: int = 0, tokenizer_dir=None,
          logit_scale: float = 30.0, **overrides) -> Path:
    """Save a tiny model of ``model_type`` and a tokenizer (``tokenizer_dir``'s, or a small BPE one) to ``out``."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    config = tiny_config(model_type, knobs, **overrides)
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config)
    except ValueError:  # an encoder
        model = AutoModel.from_config(config)
    if model.config.model_type != config.model_type:  # its causal LM takes the text config (Llama 4, Qwen 3.5): the
        try:  # type's checkpoints are its multimodal model's, which a job then loads as that causal LM
            torch.manual_seed(seed)
            model = AutoModelForImageTextToText.from_config(config)
        except ValueError:
            pass
    with torch.no_grad():
        for name, p in model.named_parameters():
            owner = name.split(".")[-3 if name.split(".")[-2] == "linear" and name.count(".") > 1 else -2]
            if p.dim() >= 2 and any(s in owner for s in SCALED):  # a wrapped linear layer (Moshi): its wrapper's name
                p.mul_(scale)
            elif "norm" in name.lower() and (p.dim() == 1 or p.dim() == 2 and "norm" in name.split(".")[-2].lower()):
                # gains per head (Cohere's q/k LayerNorm: (heads, head width)) too
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.3 * torch.randn_like(p))
            elif name.endswith("sinks"):  # learned sink logits: from a small share of the softmax to most of it
                p.copy_(torch.linspace(-2.0, 4.0, p.numel()).reshape(p.shape))
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is not None and config.model_type not in ENCODERS:  # logits of several units: logit caps and scales matter
            head.weight.mul_(logit_scale)
    out = Path(out)
    model.save_pretrained(out)
    if tokenizer_dir is None:
        from tests.conftest import _bpe_tokenizer

        _bpe_tokenizer(out, bos_prefix=True)
    else:
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out
