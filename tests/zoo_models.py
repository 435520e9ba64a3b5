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
          "exaone4", "llama4_text", "codegen")
"""Causal LM types that run exactly (tests/integration/test_families.py)."""
ENCODERS = ("bert", "roberta", "xlm-roberta", "distilbert", "electra", "modernbert")
REFUSED = ("gpt_neo", "falcon", "bloom", "deepseek_v2", "deberta-v2")
"""Types refused before Ray, each with its reason (actlake/architectures.py)."""

SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             head_dim=16, n_embd=64, n_layer=2, n_head=4, n_inner=128, rotary_dim=8, dim=64, n_layers=2, n_heads=4,
             hidden_dim=128, ffn_dim=128, word_embed_proj_dim=64, vocab_size=512, max_position_embeddings=512,
             n_positions=512, pad_token_id=1, bos_token_id=0, eos_token_id=0, moe_intermediate_size=32, num_experts=4,
             num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=32,
             global_attn_every_n_layers=2, local_attention=512, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
             qk_nope_head_dim=8, v_head_dim=16, first_k_dense_replace=0, n_group=1, topk_group=1, num_layers=2,
             max_window_layers=2, sliding_window=512, sep_token_id=2, cls_token_id=0)
KNOBS = dict(attn_logit_softcapping=2.0, final_logit_softcapping=3.0, logit_scale=0.5, logits_scaling=2.5,
             embedding_multiplier=3.0, residual_multiplier=0.7, attention_multiplier=0.3, query_pre_attn_scalar=24,
             partial_rotary_factor=0.5, floor_scale=4, attn_scale=0.5)
"""Scaling knobs away from their defaults, where a config has them (RoPE bases live in ``rope_parameters`` in
transformers 5: not set here)."""
SCALED = ("q_proj", "k_proj", "query", "key", "qkv", "c_attn", "Wqkv", "query_key_value", "q_lin", "k_lin",
          "kv_a_proj_with_mqa", "kv_b_proj", "q_b_proj")  # latent attention: the rotary key, the latent key, q


def tiny_config(model_type: str, knobs: bool = True, **overrides):
    from transformers import AutoConfig

    try:
        c = AutoConfig.for_model(model_type)
    except (KeyError, ValueError) as e:
        raise ValueError(f"{model_type}: unknown to this transformers ({e})") from None
    have = set(c.to_dict()) | set(getattr(c, "attribute_map", {}))
    n_layers = getattr(c, "num_hidden_layers", None)
    types = list(getattr(c, "layer_types", None) or [])
    for k, v in {**SIZES, **(KNOBS if knobs else {}), **overrides}.items():
        if k in have or k in overrides:
            setattr(c, k, v)
    for k, v in c.to_dict().items():  # per-layer lists (MoE layer kinds, heads per layer): the first two layers
        if (isinstance(v, list) and n_layers and len(v) == n_layers and k not in overrides and k != "layer_types"
                and getattr(type(c), k, None) is None):  # not a property
            setattr(c, k, v[:2])
    if getattr(c, "layer_types", None) is not None and "layer_types" not in overrides:  # local / global alternating
        local = any("sliding" in str(t) for t in c.layer_types) and getattr(c, "use_sliding_window", True) is not False
        other = [t for t in types if "attention" not in str(t) or "linear" in str(t)]  # a hybrid's other layers
        c.layer_types = ([other[0], "full_attention"] if other else ["sliding_attention", "full_attention"] if local
                         else ["full_attention"] * 2)
    if getattr(c, "no_rope_layers", None) is not None:
        c.no_rope_layers = [1, 0]
    if getattr(c, "kv_lora_rank", None) and "head_dim" not in overrides:  # latent attention: one key per head,
        c.head_dim, c.num_key_value_heads = c.qk_rope_head_dim, c.num_attention_heads  # rotary as wide as its dims
    return c


def build(model_type: str, out: Path, knobs: bool = True, scale: float = 8.0, seed: int = 0, tokenizer_dir=None,
          logit_scale: float = 30.0, **overrides) -> Path:
    """Save a tiny model of ``model_type`` and a tokenizer (``tokenizer_dir``'s, or a small BPE one) to ``out``."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    config = tiny_config(model_type, knobs, **overrides)
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config)
    except ValueError:  # an encoder
        model = AutoModel.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and any(s in name.split(".")[-2] for s in SCALED):
                p.mul_(scale)
            elif "norm" in name.lower() and p.dim() == 1:
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
