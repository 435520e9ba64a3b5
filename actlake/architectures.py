"""Architecture support: every feature that changes what a number means, declared per family.

A family says where a layer's blocks, attention module and key projection live, how the key rows sit in
that projection's output (``qkv``), what happens to k between the projection and the kernel (a norm,
a rotation of some layout), how the output logits are transformed (surprisal), and which features of a
config it cannot model (refused by name). Attention is read through the transformers attention
interface (:mod:`actlake.analysis.engine.capture`), so q and k are always the tensors the model uses;
each worker's first batch checks the declaration against them (:mod:`actlake.analysis.engine.selfcheck`).

Key path (METHODS.md §3): k_n = R_n(g ⊙ (x_n W_K + b_K) / r_n), r_n = rms(x_n W_K + b_K) with a key
norm (per head or over all key heads, as the model's norm module does), r_n = 1 and g = 1 without. A key LayerNorm
(no bias) subtracts the mean over its width first: y_n = x_n W_K + b_K is replaced by y_n P, P = I - 1 1^T / w over
each group of w dims it normalises, which is linear, so it is folded into W_K P and b_K P (:func:`centred`), and
r_n = sqrt(mean((y_n P)^2) + eps) is the centred input's RMS; a LayerNorm's bias beta is added after 1 / r_n
(:func:`key_shift`: part of the bias term, Persimmon). Multi-head
latent attention (DeepSeek V3): k_n = [(g ⊙ c_n / r_n) W_up | R_n(x_n W_rot + b_rot)] with the latent
c_n = x_n W_c + b_c, r_n = rms(c_n): the same form, with 1 / r_n on the latent dims only (:func:`latent_key_weights`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from dataclasses import dataclass

from actlake.errors import ConfigError, ModelLoadError
from actlake.fs import read_regular

QKV = ("separate", "stacked", "per_head", "conv1d", "codegen", "kv")
"""Where k sits in the output of the module at ``Family.key``: the whole output (``separate``); rows
[q (H d_h) | k (H_kv d_h) | v] (``stacked``); rows [k | v] of a key-value projection (``kv``; JetMoE, whose
attention repeats the key heads, tiled, once per routed query slot before the kernel: the rows tiled the same way); rows (head, [q | k | v], d_h) (``per_head``); GPT-2's Conv1D,
columns [q | k | v] (``conv1d``); CodeGen's rows (4 model-parallel blocks, [q | v | k], d/4) (``codegen``)."""
ROPE = (None, "half", "half_negated", "half_narrow", "interleaved", "interleaved_half", "sin_cos_half", "complex")
"""How positions rotate q and k: pairs (i, i + rot/2) with the model's (cos, sin) (``half``), or with -sin
(``half_negated``: NanoChat's rotate_half is (x2, -x1)), or with (cos, sin) of half width, one angle per pair
(``half_narrow``, gpt-oss); pairs (2i, 2i+1)
with (cos, sin) of full width (``interleaved``, Cohere), or with the first half of rotate-half (cos, sin), each
angle repeated (``interleaved_half``, GLM); GPT-J's (sin, cos) of half width, interleaved (``sin_cos_half``); pairs
(2i, 2i+1) multiplied by complex ``freqs_cis`` (``complex``, Llama 4, DeepSeek V2)."""
NO_INTERFACE = "attention computed outside the transformers attention interface (its q and k cannot be read)"


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    """``config.model_type`` values this family covers."""
    layers: str = "layers"
    """Dotted path from the base model to the list of transformer blocks; ``a|b``: the first that exists (Llama 4's
    multimodal model loaded whole, or as its causal LM, the text model); ``a+b``: both lists (HRM's two stacks)."""
    attention: str = "self_attn"
    """Dotted path from a block to the module that calls the attention interface."""
    key: str = "self_attn.k_proj"
    """Dotted path from a block to the module whose input is x and whose output holds k."""
    qkv: str = "separate"
    """Layout of k in that output (:data:`QKV`); ``"stacked|per_head:multi_query"``: the first when the
    config attribute after the colon is true, else the second."""
    causal: bool = True
    rope: str | None = "half"
    """:data:`ROPE`."""
    rope_layers: str | None = None
    """Config attribute listing per layer whether RoPE is applied (1) or not (0), for NoPE layers; or ``sliding``:
    RoPE on the layers ``layer_types`` calls sliding, when the config sets a window (none without one: Cohere 2); or
    ``sliding_or_all``: the same, but every layer when the config sets no window (EXAONE 4)."""
    key_norm: str | None = None
    """Dotted path from a block to an RMS-type norm applied to k before RoPE (q/k norm), or None; with ``latent``,
    the norm of the latent."""
    key_input: str | None = None
    """Dotted path from a block to an affine module whose input is x and whose output the key projection reads
    (MobileBERT's key/query bottleneck: a linear layer, then NoNorm, an elementwise affine map), folded into W_K and
    b_K (:func:`affine_map`); None: the key projection reads x itself."""
    key_norm_after_rope: bool = False
    """The key norm comes after RoPE (HunYuan): k' = g ⊙ R_n(x W_K + b_K) / r_n. Its gain is then not folded into W_K
    (it does not commute with the rotation) but applied to q' before the un-rotation (:func:`key_gain`): u(m, n) =
    W_K R_n^T (g ⊙ q'_m) / r_n. r_n is the same before or after the rotation (read from the norm's input)."""
    attention_class: str | None = None
    """Class name of the attention modules, for a hybrid whose other blocks hold another module at the same path
    (MiniMax's lightning attention, Kimi Linear's delta rule); None: every module at ``attention``."""
    latent: str | None = None
    """Multi-head latent attention: dotted path from a block to the up-projection of the normed latent (rows per
    head: [key (``qk_nope_head_dim``) | value]); ``key`` is then the down-projection whose output is [latent
    (``kv_lora_rank``) | rotary key (``qk_rope_head_dim``, shared by the heads)], and the rotary dims are the
    last of each head. Config attributes as DeepSeek V3 names them; ``rope_interleave`` read as it does."""
    logits: tuple[str, ...] = ()
    """Output-logit transforms, ``op:config_attribute`` in order: ``multiply``, ``divide``, ``softcap``."""
    refuse_if: tuple[tuple[str, str], ...] = ()
    """(config attribute, reason): a config that sets it truthy uses a feature not modelled here; ``!attr``: one that
    sets it false; ``attr=value``: one whose attribute reads ``value``."""
    refuse: str | None = None
    """Why no config of this family can be analysed exactly (then nothing else is read)."""
    decoder_alone: bool = False
    """The decoder of an encoder-decoder model (:func:`encoder_decoder`), run alone as the type's causal LM (BART's
    ``BartForCausalLM``): no encoder input, so its cross-attention modules are never called; the statistics are of its
    self-attention, and the job says so when it starts."""

    def qkv_layout(self, config) -> str:
        if "|" not in self.qkv:
            return self.qkv
        choices, _, attr = self.qkv.partition(":")
        yes, no = choices.split("|")
        return yes if getattr(config, attr, False) else no

    def rope_on(self, config, layer: int) -> bool:
        if self.rope is None:
            return False
        if self.rope_layers in ("sliding", "sliding_or_all"):
            types, window = getattr(config, "layer_types", None), getattr(config, "sliding_window", None)
            if window is None:
                return self.rope_layers == "sliding_or_all"
            return not types or types[layer] == "sliding_attention"
        if self.rope_layers is None or getattr(config, self.rope_layers, None) is None:
            return True
        return bool(getattr(config, self.rope_layers)[layer])


FAMILIES = (
    Family("bert", ("bert", "roberta", "xlm-roberta", "electra"), "encoder.layer", "attention.self",
           "attention.self.key", causal=False, rope=None),
    Family("distilbert", ("distilbert",), "transformer.layer", "attention", "attention.k_lin", causal=False, rope=None),
    Family("mobilebert", ("mobilebert",), "encoder.layer", "attention.self", "attention.self.key", causal=False,
           rope=None, key_input="bottleneck.attention", refuse_if=(
               ("!use_bottleneck", "keys from the layer input without a bottleneck"),
               ("use_bottleneck_attention", "keys from the layer-input bottleneck"),
               ("!key_query_shared_bottleneck", "keys from the layer input beside a bottleneck"),
               ("normalization_type=layer_norm", "a LayerNorm in the key bottleneck (not affine)"))),
    Family("albert", ("albert",), "encoder.albert_layer_groups", "albert_layers.0.attention",
           "albert_layers.0.attention.key", causal=False, rope=None),  # a group's block runs once per layer: LOOPS
    Family("modernbert", ("modernbert",), attention="attn", key="attn.Wqkv", qkv="stacked", causal=False),
    Family("gpt2", ("gpt2",), "h", "attn", "attn.c_attn", qkv="conv1d", rope=None),
    Family("gpt_bigcode", ("gpt_bigcode",), "h", "attn", "attn.c_attn", qkv="stacked|per_head:multi_query", rope=None),
    Family("gpt_neox", ("gpt_neox",), attention="attention", key="attention.query_key_value", qkv="per_head"),
    Family("gptj", ("gptj",), "h", "attn", "attn.k_proj", rope="sin_cos_half"),
    Family("codegen", ("codegen",), "h", "attn", "attn.qkv_proj", qkv="codegen", rope="sin_cos_half"),
    Family("opt", ("opt",), "decoder.layers", rope=None),
    Family("llama", ("llama", "mistral", "ministral", "mixtral", "qwen2", "qwen2_moe", "gemma", "olmo", "starcoder2")),
    Family("smollm3", ("smollm3",), rope_layers="no_rope_layers"),
    Family("llama_layout", ("arcee", "aria_text", "bitnet")),  # found exact by the zoo
    Family("biogpt", ("biogpt",), rope=None),
    Family("granite", ("granite",), logits=("divide:logits_scaling",)),
    Family("phi", ("phi",), key_norm="self_attn.k_layernorm"),  # with qk_layernorm: a LayerNorm with a bias, per head
    Family("stablelm", ("stablelm",), refuse_if=(("qk_layernorm", "per-head q/k LayerNorm (qk_layernorm: true)"),)),
    Family("phi3", ("phi3",), key="self_attn.qkv_proj", qkv="stacked"),
    Family("cohere", ("cohere",), rope="interleaved", logits=("multiply:logit_scale",), key_norm="self_attn.k_norm"),
    # use_qk_norm: a LayerNorm per head (no bias), its centring folded into W_K (norm_affine)
    Family("cohere2", ("cohere2",), rope="interleaved", rope_layers="sliding", logits=("multiply:logit_scale",)),
    Family("gemma2", ("gemma2",), logits=("softcap:final_logit_softcapping",)),
    Family("qk_norm", ("qwen3", "qwen3_moe", "olmo2", "olmoe", "olmo3", "apertus", "apertus1p5_text"),
           key_norm="self_attn.k_norm"),
    Family("gemma3", ("gemma3_text",), key_norm="self_attn.k_norm", logits=("softcap:final_logit_softcapping",)),
    Family("exaone4", ("exaone4",), key_norm="self_attn.k_norm", rope_layers="sliding_or_all"),  # global: NoPE
    Family("no_interface", ("gpt_neo", "falcon", "bloom", "deberta-v2", "mpt"), refuse=NO_INTERFACE),
    Family("deepseek_v3", ("deepseek_v3",), key="self_attn.kv_a_proj_with_mqa", key_norm="self_attn.kv_a_layernorm",
           latent="self_attn.kv_b_proj"),
    Family("deepseek_v2", ("deepseek_v2",), key="self_attn.kv_a_proj_with_mqa", key_norm="self_attn.kv_a_layernorm",
           latent="self_attn.kv_b_proj", rope="complex"),  # latent keys, their rotary dims in complex pairs
    Family("gpt_oss", ("gpt_oss",), rope="half_narrow"),  # learned sinks: read from the kernel call (capture.py)
    Family("llama4_text", ("llama4_text",), rope="complex", rope_layers="no_rope_layers", key_norm="self_attn.qk_norm"),
    Family("llama4", ("llama4",), "layers|language_model.model.layers", rope="complex", rope_layers="no_rope_layers",
           key_norm="self_attn.qk_norm"),  # the multimodal model: a job loads its causal LM (the text model above)
    # the L2 q/k norm (no gain) on its RoPE layers only, after the rotation it commutes with; chunked attention: below
    Family("assistant", ("gemma4_assistant", "gemma4_unified_assistant"), refuse="a drafter (assistant) model attends "
           "to its target model's keys and values (shared_kv_states), which a run of the drafter alone does not have"),
)


def supported_model_types() -> list[str]:
    return sorted(t for f in FAMILIES if f.refuse is None for t in f.model_types)


def declared(model_type: str) -> Family | None:
    return next((f for f in FAMILIES if model_type in f.model_types), None)


def family_for(model_type: str) -> Family:
    for fam in FAMILIES:
        if model_type in fam.model_types:
            return fam
    raise ModelLoadError(f"model_type {model_type!r} is not supported: actlake has no declaration of where its "
                         f"attention's keys come from (supported: {', '.join(supported_model_types())}; "
                         "docs/models.md)")


def check_config(config) -> Family:
    """The family of a transformers config, or a one-line ModelLoadError naming the model type and the feature
    that is not modelled (a refused family, a refused config attribute). Sliding windows need no declaring: the
    kernel is handed each layer's window, and the statistics count the pairs it attends."""
    text = text_config(config)
    check_heads(text)
    check_streams(text)
    if declared(config.model_type) is None:
        from actlake.discovery import discover

        return check_clip(config, discover(config))
    fam = family_for(config.model_type)
    what = f"model_type {config.model_type!r}"
    if fam.refuse:
        raise ModelLoadError(f"{what} is not supported: {fam.refuse}")
    check_clip(text, fam)
    for attr, reason in fam.refuse_if:
        name, _, value = attr.lstrip("!").partition("=")
        have = getattr(config, name, None)
        if (str(have) == value if value else (have is not None and not have) if attr.startswith("!") else bool(have)):
            raise ModelLoadError(f"{what} with {name}: {have!r} is not supported: {reason} is not modelled yet")
    return fam


def check_clip(config, fam: Family) -> Family:
    """Clipped keys are modelled on a plain key path only (no key norm, latent or map before the projection)."""
    clip = clip_qkv(text_config(config))
    if clip and (fam.key_norm or fam.latent or fam.key_input):
        raise ModelLoadError(f"model_type {config.model_type!r} with clip_qkv: {clip!r} is not supported: clipped keys "
                             "with a key norm, latent keys or a map before the key projection are not modelled")
    return fam


def text_config(config):
    """The config of a model's text decoder (a multimodal config's ``text_config``), else the config itself (also
    where transformers finds several and will not choose: MusicGen's text encoder and decoder)."""
    try:
        return config.get_text_config() if hasattr(config, "get_text_config") else config
    except ValueError:
        return config


def global_attr(config, name: str, default=None):
    """``config.name``, or ``default``; for a heterogeneous config (transformers' ``per_layer_config``) the global
    value, which reading the attribute itself refuses when some layers override it."""
    read = getattr(config, "_getattr_without_heterogeneous_validation", None)
    if read is not None:
        return read(name, default)
    return getattr(config, name, default)


def layer_config(config, block, family: Family):
    """The config of one block: ``config.per_layer_config[i]`` for a heterogeneous config (layers that override
    ``kv_lora_rank``, head widths, windows), ``i`` the block's attention module's ``layer_idx``; else ``config``."""
    if not getattr(config, "is_heterogeneous", False):
        return config
    i = getattr(get_path(block, family.attention), "layer_idx", None)
    return config if i is None else config.per_layer_config[i]


def encoder_decoder(config) -> bool:
    """Whether the model type is an encoder-decoder one: its config says so, or its config class does (a checkpoint of
    the decoder alone, ``BartForCausalLM``'s, saves ``is_encoder_decoder: false``)."""
    return bool(getattr(config, "is_encoder_decoder", False) or getattr(type(config), "is_encoder_decoder", False))


def query_heads(config) -> int:
    """Query heads of the attention layers a job records: ``num_attention_heads``, or an encoder-decoder model's
    ``decoder_attention_heads`` (its decoder runs alone; ``num_attention_heads`` reads the encoder's there)."""
    for name in ("decoder_attention_heads", "num_decoder_attention_heads"):
        if encoder_decoder(config) and isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    return global_attr(config, "num_attention_heads")


def check_heads(config) -> None:
    """Query heads that differ between layers (a per-layer list of head counts, a count for some layers only, a
    ``per_layer_config`` override) are refused by name: every attention table has one row per head of every layer.
    An encoder-decoder model's encoder heads are not looked at (its decoder runs alone)."""
    h = query_heads(config)
    counts = {}
    for k, v in vars(config).items():
        if encoder_decoder(config) and "encoder" in k:
            continue
        if "attention_heads" in k and k not in ("num_attention_heads", "decoder_attention_heads",
                                                "num_decoder_attention_heads"):
            for n in (v if isinstance(v, (list, tuple)) else [v]):
                if isinstance(n, int) and not isinstance(n, bool) and n != h:
                    counts.setdefault(k, n)
    if getattr(config, "is_heterogeneous", False):
        for i, o in config._heterogeneity_spec.per_layer_overrides.items():
            if o.get("num_attention_heads", h) != h:
                counts.setdefault(f"per_layer_config[{i}].num_attention_heads", o["num_attention_heads"])
    if h is not None and counts:
        k, n = next(iter(counts.items()))
        raise ModelLoadError(f"model_type {config.model_type!r} is not supported: its layers have different numbers of "
                             f"query heads (num_attention_heads {h}, {k} {n}), which the per-head tables (the same "
                             "heads in every layer) do not model yet")


STREAMS = ("altup_num_inputs", "hc_mult", "hc_count")
"""Config attributes that give each token several residual streams (Gemma 3n's AltUp, hyper-connections)."""
def _int(config, attr: str):
    n = global_attr(config, attr)
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def _groups(config) -> int | None:
    """ALBERT: ``num_hidden_layers`` layers run the blocks of ``num_hidden_groups`` groups (one call per layer)."""
    groups, n = _int(config, "num_hidden_groups"), _int(config, "num_hidden_layers")
    if groups is None or n is None:
        return None
    if (_int(config, "inner_group_num") or 1) > 1:  # also with a group per layer: still several blocks per call
        raise ModelLoadError(f"model_type {config.model_type!r} with inner_group_num {config.inner_group_num} is not "
                             "supported: several blocks per group call (one hidden state per group call, one attention "
                             "call per block) are not modelled yet")
    return n if groups < n else None


def _recurrent(config) -> int | None:
    """Dory: the input layers, the recurrent ones ``n_recurrent_loops`` times, then the output layers."""
    loops = _int(config, "n_recurrent_loops")
    if loops is None or loops <= 1:
        return None
    stack = list(range(config.num_hidden_layers))
    a, b, c = config.n_input_layers, config.n_recurrent_layers, config.n_output_layers
    return len(stack[:a]) + loops * len(stack[a : a + b]) + len(stack[len(stack) - c :])


def _cycles(config) -> int | None:
    """HRM: per high cycle, the low stack ``L_cycles`` times, then the high stack, ``H_cycles`` times."""
    high, low, per = _int(config, "H_cycles"), _int(config, "L_cycles"), _int(config, "num_layers_per_stack")
    if high is None or low is None or per is None or high * (low + 1) <= 1:
        return None
    return per * high * (low + 1)


LOOPS = (("num_hidden_groups", _groups), ("n_recurrent_loops", _recurrent), ("H_cycles", _cycles))
"""Config attributes that run blocks several times per forward pass (ALBERT's shared groups, Dory's recurrent depth,
HRM's cycles), each with the number of attention calls a forward pass makes under it."""


def attention_calls(config) -> int | None:
    """Call-order layers: the number of attention calls one forward pass makes where the config runs blocks several
    times (:data:`LOOPS`), else None (each attention module is one layer). Layer k is then the k-th attention call of a
    pass and hidden state k + 1 the k-th block call's output; each pass is checked to make exactly this many calls."""
    found = [(attr, n) for attr, count in LOOPS if (n := count(config)) is not None]
    if len(found) > 1:
        raise ModelLoadError(f"model_type {config.model_type!r} is not supported: {found[0][0]} and {found[1][0]} both "
                             "repeat its blocks, which is not modelled")
    return found[0][1] if found else None


def layers_of(config) -> int:
    """The layers a job counts for a model of ``config`` (hidden states 0..n; the layer axis of its statistics), as
    the engine counts them on the loaded model: the attention calls of a pass for call-order layers
    (:func:`attention_calls`), an encoder-decoder model's decoder layers (its decoder runs alone), else
    ``num_hidden_layers``; a multimodal config's text model's."""
    text = text_config(config)
    calls = attention_calls(text)
    if calls is not None:
        return calls
    if encoder_decoder(text):
        for name in ("decoder_layers", "num_decoder_layers"):
            if isinstance(getattr(text, name, None), int):
                return getattr(text, name)
    return global_attr(text, "num_hidden_layers")


def resolve_layers(layers: list[int], n_layers: int, key=lambda i: f"activations.layers[{i}]") -> list[int]:
    """Config layer numbers (negative from the end) -> hidden-state indices 0..n_layers, sorted, each once; a
    ConfigError naming the entry (``key(i)``) out of range."""
    out = []
    for i, layer in enumerate(layers):
        idx = layer if layer >= 0 else n_layers + 1 + layer
        if not 0 <= idx <= n_layers:
            raise ConfigError(f"{key(i)}: layer {layer} out of range for a model with {n_layers} layers "
                              f"(hidden states 0..{n_layers})")
        out.append(idx)
    return sorted(set(out))


def check_streams(config) -> None:
    """Refused by name: several residual streams per token (:data:`STREAMS` above 1: the per-token hidden-state
    statistics assume one vector per token) and blocks repeated in a way :func:`attention_calls` cannot count."""
    what = f"model_type {config.model_type!r}"
    for attr in STREAMS:
        n = global_attr(config, attr)
        if isinstance(n, int) and not isinstance(n, bool) and n > 1:
            raise ModelLoadError(f"{what} is not supported: {attr} {n} gives each token {n} residual streams, which "
                                 "the per-token statistics (one hidden state per token) do not model yet")
    attention_calls(config)  # refuses a repetition it cannot count


def clip_qkv(config) -> float | None:
    """The bound of clipped q/k/v (``clip_qkv``: k = clamp(x W_K + b_K, -c, c), OLMo, DBRX), or None. Modelled: the
    clip's correction clamp(y_n) - y_n joins the bias term (the recorder's ``clip_shift``, METHODS.md §3)."""
    clip = global_attr(config, "clip_qkv") or getattr(global_attr(config, "attn_config"), "clip_qkv", None)
    return float(clip) if clip else None


INDEXERS = ("index_topk", "indexer_budget")
"""Config attributes of a learned indexer that lets each query attend to that many keys only (DeepSeek V3.2's sparse
attention, Qwen4-Exp's QSA): exact while a window holds no more tokens."""


def check_chunks(config, max_length: int) -> None:
    """Chunked attention (Llama 4: queries see only keys of their own chunk of ``attention_chunk_size`` tokens) is
    not modelled: refused by name when a window is longer than a chunk (shorter windows never cross one). The same
    for a sparse attention's learned indexer (:data:`INDEXERS`): a window longer than the keys it keeps is refused
    (shorter ones attend to every key, like dense attention)."""
    for attr in INDEXERS:
        top = global_attr(config, attr)
        if isinstance(top, int) and max_length > top:
            raise ModelLoadError(f"model_type {config.model_type!r} with {attr} {top} and tokenization.max_length "
                                 f"{max_length}: sparse attention (each query attends to the {top} keys its indexer "
                                 f"picks) is not modelled yet; set tokenization.max_length to {top} or less")
    text = text_config(config)  # a multimodal model's chunks are its text model's (Llama 4)
    chunk = getattr(text, "attention_chunk_size", None)
    chunked = any("chunked" in str(t) for t in getattr(text, "layer_types", None) or ["chunked_attention"])
    if chunk and chunked and max_length > chunk:
        raise ModelLoadError(f"model_type {config.model_type!r} with attention_chunk_size {chunk} and "
                             f"tokenization.max_length {max_length}: chunked attention (keys of a query's own chunk "
                             f"only) is not modelled yet; set tokenization.max_length to {chunk} or less")


def read_model_config(name_or_path: str, revision=None, trust_remote_code: bool = False):
    """The transformers config of a model (no weights): ``config.json`` of a local folder through
    ``AutoConfig.for_model``, a hub id through ``AutoConfig.from_pretrained``."""
    from transformers import AutoConfig

    try:
        if os.path.isdir(name_or_path):
            data = json.loads(read_regular(os.path.join(name_or_path, "config.json"), "model.name_or_path", ConfigError))
            if "model_type" not in data:
                raise ConfigError(f"model.name_or_path: {name_or_path}/config.json names no model_type")
        return AutoConfig.from_pretrained(name_or_path, revision=revision, trust_remote_code=trust_remote_code)
    except (ModelLoadError, ConfigError):
        raise
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a config it cannot read
        raise ModelLoadError(f"model {name_or_path}: cannot read its config ({type(e).__name__}: {e})") from None


def get_path(obj, dotted: str):
    for part in dotted.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def blocks(base_model, family: Family):
    """The transformer blocks of a base model (``AutoModel``) or a model with a head; ``a+b``: both lists, in order
    (HRM's two stacks, whose blocks are called in an order of their own: call-order layers)."""
    for candidate in (base_model, getattr(base_model, "base_model", None)):
        for path in family.layers.split("|"):
            try:
                return [b for part in path.split("+") for b in get_path(candidate, part)]
            except AttributeError:
                continue
    raise ModelLoadError(f"{family.name}: cannot find layers at '{family.layers}' in {type(base_model).__name__}")


def check_loaded(loaded, base_model, family: Family, missing_keys, path: str, head: bool = True) -> None:
    """Refused by name: a checkpoint that leaves weights of the transformer blocks to random initialisation
    (``missing_keys`` of ``from_pretrained``, named as in ``loaded``): a multimodal checkpoint whose type's causal LM
    does not map its keys (Emu3) would otherwise be analysed as a random model, with every check passing. Likewise
    its input embeddings and, where ``head`` (the job reads the logits), its output head."""
    if not missing_keys:
        return
    ours = {id(p) for b in blocks(base_model, family) for p in b.parameters()}
    hit = []
    for name in sorted(missing_keys):
        try:
            param = loaded.get_parameter(name)
        except AttributeError:
            continue
        if id(param) in ours:
            hit.append(name)
    if hit:
        raise ModelLoadError(f"model {path}: {len(hit)} weights of its transformer blocks are not in the checkpoint "
                             f"under the names {type(loaded).__name__} reads (e.g. {hit[0]}), so they would be random: "
                             "a checkpoint of another class than the one transformers loads for this model type?")
    ends = {id(p) for m in _embeddings(loaded if head else None, base_model) for p in m.parameters()}
    hit = [name for name in sorted(missing_keys) if id(_parameter(loaded, name)) in ends]
    if hit:
        raise ModelLoadError(f"model {path}: its embeddings or output head ({', '.join(hit[:2])}) are not in the "
                             f"checkpoint under the names {type(loaded).__name__} reads, so they would be random: a "
                             "checkpoint of another class than the one transformers loads for this model type?")


def _parameter(model, name: str):
    try:
        return model.get_parameter(name)
    except AttributeError:
        return None


def _embeddings(loaded, base_model) -> list:
    """The input embeddings of the base model and the output embeddings of the model loaded (where it has them)."""
    found = []
    for model, get in ((base_model, "get_input_embeddings"), (loaded, "get_output_embeddings")):
        if model is None:
            continue
        try:
            m = getattr(model, get)()
        except (AttributeError, NotImplementedError):
            continue
        if m is not None:
            found.append(m)
    return found


def key_weights(block, family: Family, config, n_heads: int, n_kv_heads: int, head_dim: int) -> tuple:
    """The key path of one block as (W_K (H_kv, d, d_h), b_K (H_kv, d_h) or None), in float32, with the key
    norm's gain folded in (W_K g, b_K g). Head counts and width come from the kernel's q and k."""
    config = layer_config(config, block, family)
    if family.latent is not None:
        return latent_key_weights(block, family, config, n_kv_heads, head_dim)
    mod = get_path(block, family.key)
    with onloaded(mod):  # the tensors read here stay valid when an offloaded module goes back to meta
        w = mod.weight.detach().float()
        b = mod.bias.detach().float() if getattr(mod, "bias", None) is not None else None
    layout, kd = family.qkv_layout(config), n_kv_heads * head_dim
    if family.key_input is not None:  # k = (x A + c) W + b: W A^T and W c + b (the kernel's rows picked below)
        pre = get_path(block, family.key_input)
        a, c = affine_map(pre, getattr(pre, "in_features", None) or _in_width(pre))
        w, b = w @ a.T.to(w), w @ c.to(w) + (b if b is not None else 0)
    if layout == "conv1d":  # Conv1D (d, 3d): columns [q | k | v]
        w, b = w.T, b
    if layout in ("stacked", "conv1d"):
        start = n_heads * head_dim
        w, b = w[start : start + kd], (b[start : start + kd] if b is not None else None)
    elif layout == "codegen":  # rows (4, [q | v | k], d / 4): its 4 model-parallel shards, interleaved
        w = w.reshape(4, 3, kd // 4, -1)[:, 2].reshape(kd, -1)
        b = b.reshape(4, 3, kd // 4)[:, 2].reshape(kd) if b is not None else None
    elif layout == "kv":  # rows [k | v]; the kernel's k: those heads tiled (JetMoE's key_states.repeat(1, top_k, 1, 1))
        rows = w.shape[0] // 2
        w, b = w[:rows], (b[:rows] if b is not None else None)
        if kd != rows and rows and kd % rows == 0:
            w = w.reshape(-1, head_dim, w.shape[-1]).repeat(kd // rows, 1, 1).reshape(kd, -1)
            b = b.reshape(-1, head_dim).repeat(kd // rows, 1).reshape(kd) if b is not None else None
    elif layout == "per_head" and w.shape[0] == 3 * kd:  # rows (H, [q | k | v], d_h)
        w = w.reshape(n_kv_heads, 3, head_dim, -1)[:, 1].reshape(kd, -1)
        b = b.reshape(n_kv_heads, 3, head_dim)[:, 1].reshape(kd) if b is not None else None
    if w.shape[0] != kd:
        raise ModelLoadError(f"{family.name}: {family.key} gives {w.shape[0]} key rows, the kernel's k has {kd} "
                             f"({n_kv_heads} heads of {head_dim}): the declared qkv layout {layout!r} is wrong")
    wk = w.reshape(n_kv_heads, head_dim, -1).transpose(1, 2).contiguous()  # (H_kv, d, d_h)
    bk = b.reshape(n_kv_heads, head_dim) if b is not None else None
    norm = key_norm_module(block, family)
    if norm is not None and family.key_norm_after_rope:
        key_gain(block, family, n_kv_heads, head_dim)  # refuses a centring norm; its gain stays out of W_K
    elif norm is not None:
        g, width, _ = norm_affine_shift(norm, head_dim)  # its bias: key_shift
        if width:  # a LayerNorm: its mean subtraction over its width is linear, folded into W_K and b_K
            wk, bk = centred(wk, width), (centred(bk[:, None], width)[:, 0] if bk is not None else None)
        g = g.reshape(-1, head_dim).expand(n_kv_heads, head_dim)  # (H_kv, d_h)
        wk, bk = wk * g[:, None], (bk * g if bk is not None else None)
    return wk, bk


def key_shift(block, family: Family, n_kv_heads: int, head_dim: int):
    """(H_kv, d_h) float32 bias beta of a key LayerNorm (k = R_n(g ⊙ (y P) / r_n + beta), METHODS.md §3), added after
    the norm's 1 / r_n, or None (no key norm, or one without a bias)."""
    norm = key_norm_module(block, family)
    if norm is None or family.latent is not None:
        return None
    shift = norm_affine_shift(norm, head_dim)[2]
    if shift is None:
        return None
    if family.key_norm_after_rope:
        raise ModelLoadError(f"{family.name}: a key norm with a bias after RoPE is not modelled")
    return shift.reshape(-1, head_dim).expand(n_kv_heads, head_dim).contiguous()


def key_gain(block, family: Family, n_kv_heads: int, head_dim: int):
    """(H_kv, d_h) float32 gain g of a key norm that comes after RoPE (``Family.key_norm_after_rope``), or None (no
    such norm in this block). A LayerNorm there is refused: its centring does not commute with the rotation."""
    norm = key_norm_module(block, family) if family.key_norm_after_rope else None
    if norm is None:
        return None
    g, width = norm_affine(norm, head_dim)
    if width:
        raise ModelLoadError(f"{family.name}: a key LayerNorm after RoPE (its mean subtraction does not commute with the "
                             "rotation) is not modelled")
    return g.reshape(-1, head_dim).expand(n_kv_heads, head_dim).contiguous()


def _in_width(module) -> int:
    """The input width of a module: its first linear layer's."""
    import torch

    return next(m.in_features for m in module.modules() if isinstance(m, torch.nn.Linear))


def centred(w, width: int):
    """W (H_kv, d, d_h) with the mean over each group of ``width`` key dims subtracted (a LayerNorm's centring: per head
    when ``width`` is d_h, over all key heads when it is H_kv d_h)."""
    H, d, dh = w.shape
    if width == dh:
        return w - w.mean(-1, keepdim=True)
    if width != H * dh:
        raise ModelLoadError(f"a key LayerNorm over {width} dims, where k has {H} heads of {dh}: not modelled")
    flat = w.transpose(0, 1).reshape(d, H * dh)
    return (flat - flat.mean(-1, keepdim=True)).reshape(d, H, dh).transpose(0, 1).contiguous()


def latent_key_weights(block, family: Family, config, n_heads: int, head_dim: int) -> tuple:
    """:func:`key_weights` of multi-head latent attention: per head, W_K = [W_c g W_up,h | W_rot] (H, d, d_h) and
    b_K = [b_c g W_up,h | b_rot], the latent norm's 1 / r_n applied on the latent dims by the engine
    (:meth:`~actlake.analysis.engine.layer_qk.LayerQK.scale_keys`). DeepSeek's ``rope_interleave`` takes the rotary
    dims in pairs (2i, 2i + 1) and returns them in rotate-half order: that fixed permutation is folded into W_rot."""
    import torch

    down, up = get_path(block, family.key), get_path(block, family.latent)
    c, r, nope = config.kv_lora_rank, config.qk_rope_head_dim, config.qk_nope_head_dim
    with onloaded(down), onloaded(up):
        wa = down.weight.detach().float()  # (c + r, d)
        ba = down.bias.detach().float() if getattr(down, "bias", None) is not None else None
        wb = up.weight.detach().float().reshape(n_heads, -1, c)[:, :nope]  # (H, nope, c)
    if nope + r != head_dim or wa.shape[0] != c + r:
        raise ModelLoadError(f"{family.name}: {family.key} gives {wa.shape[0]} rows and the kernel's k has {head_dim} "
                             f"dims, where kv_lora_rank {c}, qk_rope_head_dim {r} and qk_nope_head_dim {nope} need "
                             f"{c + r} and {nope + r}: the declared latent layout is wrong")
    g, centring = norm_affine(get_path(block, family.key_norm), c)
    if centring:
        raise ModelLoadError(f"{family.name}: a LayerNorm on the latent of multi-head latent attention is not modelled")
    g = g.reshape(c)
    order = (torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2)]) if rope_interleaved(block, family, config)
             else torch.arange(r))
    w_rot = wa[c:][order].T  # (d, r)
    wk = torch.cat([torch.einsum("cd,c,hkc->hdk", wa[:c], g, wb), w_rot.expand(n_heads, *w_rot.shape)], -1)
    bk = None
    if ba is not None:
        bk = torch.cat([torch.einsum("c,c,hkc->hk", ba[:c], g, wb), ba[c:][order].expand(n_heads, r)], -1)
    return wk.contiguous(), bk


def rope_interleaved(block, family: Family, config) -> bool:
    """Whether multi-head latent attention takes its rotary dims in pairs (2i, 2i + 1): the config's ``rope_interleave``
    where it has one (DeepSeek V3), else whether the attention module's ``forward`` calls
    ``apply_rotary_pos_emb_interleave`` (DeepSeek V3.2 and GLM-5 always do, with no config attribute)."""
    flag = getattr(config, "rope_interleave", None)
    if flag is not None:
        return bool(flag)
    import inspect

    try:
        return "apply_rotary_pos_emb_interleave(" in inspect.getsource(type(get_path(block, family.attention)).forward)
    except (OSError, TypeError):
        return False


def latent_scaled_dims(family: Family, config, head_dim: int):
    """(d_h,) float32: 1 on the latent dims of a multi-head latent attention key (what its norm scales), 0 on the
    rotary ones; None for any other family (a key norm scales every dim)."""
    if family.latent is None:
        return None
    import torch

    rot = global_attr(config, "qk_rope_head_dim")  # the same in every layer (the rotary key is shared by the heads)
    return torch.cat([torch.ones(head_dim - rot), torch.zeros(rot)])


def key_norm_gain(norm, n_kv_heads: int, head_dim: int):
    """(H_kv, d_h) float32 gain g of an RMS-type key norm (:func:`norm_affine`)."""
    return norm_affine(norm, head_dim)[0].reshape(-1, head_dim).expand(n_kv_heads, head_dim)


def norm_affine(norm, head_dim: int) -> tuple:
    """(g, width) of a key norm (:func:`norm_affine_shift`); a LayerNorm with a bias is refused here (the callers that
    model its bias, :func:`key_shift`, read it from :func:`norm_affine_shift`)."""
    g, width, shift = norm_affine_shift(norm, head_dim)
    if shift is not None:
        raise ModelLoadError(f"a key norm ({type(norm).__name__}) that subtracts the mean and adds a bias: the bias is a "
                             "term of k that 1 / r does not scale, which is not modelled here")
    return g, width


def norm_affine_shift(norm, head_dim: int) -> tuple:
    """(g, width, beta) of a key norm, read from the module itself so the variant needs no declaring: its gain g (w,
    1 + w, or none; float32, the shape of its output for one vector), ``width``, the number of dims whose mean it
    subtracts (a LayerNorm: k = g ⊙ (y - mean(y)) / r + beta, r = sqrt(var(y) + eps)), or 0 for an RMS-type norm
    (r = rms(y)), and a LayerNorm's bias beta (None where it has none, or for an RMS-type norm).
    Probed with a vector of ones and one of alternating ±1 (mean 0, RMS 1): an RMS norm maps both to g (times ±1), a
    LayerNorm maps ones to its bias and the alternating one to g ⊙ ±1 / sqrt(1 + eps) + beta."""
    import torch

    width = getattr(norm, "weight", None)
    width = width.shape[-1] if width is not None else head_dim
    with onloaded(norm), torch.no_grad():
        p = next(norm.parameters(), None)
        kw = {"dtype": p.dtype if p is not None else torch.float32, "device": p.device if p is not None else "cpu"}
        ones = torch.ones(1, width, **kw)
        signs = ones.clone()
        signs[:, 1::2] = -1
        rescale = (1.0 + norm_eps(norm)) ** 0.5  # forward: no hooks (LayerInputs keeps inputs)
        a, b = (norm.forward(v).float() * rescale for v in (ones, signs))
        a, b = (t[0] if t.shape[0] == 1 else t for t in (a, b))  # (width,); (H_kv, d_h) for a gain per head (Cohere)
    signs = signs[0].float()
    if torch.allclose(a, b * signs, rtol=1e-3, atol=1e-6 * float(a.abs().max().clamp(min=1e-30))):
        return a, 0, None  # RMS-type: g from either
    if width % 2:
        raise ModelLoadError(f"a key norm ({type(norm).__name__}) over an odd width that is not an RMS norm: not modelled")
    if float(a.abs().max()) <= 1e-6 * float(b.abs().max().clamp(min=1e-30)):
        return b * signs, width, None  # a LayerNorm without a bias
    return (b - a) * signs, width, a / rescale  # with a bias: LN(ones) = beta


def rms_eps(norm, width: int) -> float:
    """The ε of an RMS-type key norm as k = g ⊙ y / sqrt(mean(y²) + ε) has it: the norm's own ε where it averages
    the squares (RMSNorm), ε / width where it sums them (an L2 norm: Dory's x / sqrt(sum(x²) + ε)). Told apart by
    probing the norm with s·1 and 1 for s² = ε (the ratio of its outputs is sqrt(1 + ε') / (s sqrt(s² + ε')) for its
    own ε')."""
    import torch

    eps = norm_eps(norm)
    if eps <= 0:
        return eps
    with onloaded(norm), torch.no_grad():
        p = next(norm.parameters(), None)
        kw = {"dtype": p.dtype if p is not None else torch.float32, "device": p.device if p is not None else "cpu"}
        ones = torch.ones(1, width, **kw)
        a, b = (norm.forward(v).double() for v in (ones, ones * eps ** 0.5))
    keep = a.abs() > 0
    got = float((b[keep] / a[keep]).mean()) / eps ** 0.5
    ratio = lambda e: ((1 + e) / (eps + e)) ** 0.5
    return min((eps, eps / width), key=lambda e: abs(math.log(got / ratio(e))))


def norm_eps(norm) -> float:
    for attr in ("variance_epsilon", "eps", "epsilon"):
        if getattr(norm, attr, None) is not None:
            return float(getattr(norm, attr))
    return 1e-6


def logit_transform(family: Family, config):
    """The model's own transform of its output logits (float32 in, out), or None."""
    text = text_config(config)  # a multimodal model's logit transform is its text model's

    def value(attr):
        own = getattr(config, attr, None)
        return own if own is not None else getattr(text, attr, None)
    ops = [(op, float(value(attr))) for op, attr in (s.split(":") for s in family.logits) if value(attr) is not None]
    if not ops:
        return None
    import torch

    def transform(logits):
        for op, v in ops:
            logits = (logits * v if op == "multiply" else logits / v if op == "divide"
                      else torch.tanh(logits / v) * v)
        return logits
    return transform


def onloaded(module):
    """Context in which ``module``'s parameters hold their values on the device the module runs on, also
    when accelerate offloaded them (``device_map`` with CPU or disk offload keeps them on the meta device
    outside the module's forward pass). A plain context for any other module."""
    hook = getattr(module, "_hf_hook", None)
    if hook is None or not getattr(hook, "offload", False):
        return contextlib.nullcontext()
    from accelerate.utils import align_module_device

    return align_module_device(module)


def key_input_module(block, family: Family):
    """The module whose input is x (the key projection, the fused QKV projection, or an affine map before it)."""
    return get_path(block, family.key_input or family.key)


def affine_map(module, width: int) -> tuple:
    """(A (d, d'), c (d',)) float32 with module(x) = x A + c for every x (d wide), probed in float64 on a copy: its
    outputs for 0 and the basis vectors; refused where it is not affine (twice a basis vector must give twice A)."""
    import copy

    import torch

    with onloaded(module), torch.no_grad():
        probe = copy.deepcopy(module).to(device="cpu", dtype=torch.float64)
        eye = torch.eye(width, dtype=torch.float64)
        c = probe(torch.zeros(1, width, dtype=torch.float64))[0]
        a = probe(eye) - c
        twice = probe(2 * eye) - c
    if not torch.allclose(twice, 2 * a, rtol=1e-9, atol=1e-12 * float(a.abs().max().clamp(min=1e-30))):
        raise ModelLoadError(f"the module before the key projection ({type(module).__name__}) is not affine in x, which "
                             "the contributions (a sum over x's dimensions) do not model")
    return a.float(), c.float()


def key_norm_module(block, family: Family):
    """The block's key norm, or None (no declared norm, or a block without one: Llama 4's NoPE layers)."""
    if not family.key_norm:
        return None
    try:
        return get_path(block, family.key_norm)
    except AttributeError:
        return None


def precheck(cfg) -> None:
    """:func:`check_config` on a local model folder's ``config.json`` read as plain JSON: no torch, no transformers
    (the command line refuses an unsupported model this way before importing the job's code). Hub ids and
    packaged models are left to :func:`check_model`."""
    import types

    from actlake.config import resolve_model_path

    path = resolve_model_path(cfg.model.name_or_path)
    if not os.path.isdir(path):
        return
    data = json.loads(read_regular(os.path.join(path, "config.json"), "model.name_or_path", ConfigError))
    if isinstance(data, dict) and isinstance(data.get("model_type"), str) and declared(data["model_type"]):
        config = types.SimpleNamespace(**data)
        check_config(config)  # an undeclared type is left to check_model's discovery
        check_chunks(config, cfg.tokenization.max_length)


def check_model(cfg) -> Family:
    """A job's model, checked from its config alone (no weights) before Ray starts: one line naming the model
    type and what is not modelled, else its family."""
    from actlake.config import resolve_model_path

    m = cfg.model
    config = read_model_config(resolve_model_path(m.name_or_path), m.revision, m.trust_remote_code)
    fam = check_config(config)
    check_chunks(config, cfg.tokenization.max_length)
    calls = attention_calls(text_config(config))
    if calls is not None and getattr(cfg, "interventions", None):
        raise ModelLoadError(f"model_type {config.model_type!r} with interventions is not supported: its blocks run "
                             f"several times per forward pass ({calls} attention calls), and editing a hidden state of "
                             "call-order layers is not modelled yet")
    log = logging.getLogger("actlake.run")
    if declared(config.model_type) is None:
        from actlake.discovery import describe

        log.warning("model_type %r has no declaration; found %s; each worker's first batch checks it against the "
                    "model's own numbers", config.model_type, describe(fam))
    if fam.decoder_alone:
        log.warning("model_type %r: %s", config.model_type, DECODER_ALONE)
    return fam


DECODER_ALONE = ("an encoder-decoder model: its decoder runs alone (the type's causal LM), without an encoder input "
                 "and so without its cross-attention; the statistics are of the decoder's self-attention and surprisal "
                 "is of the causal LM's own logits (without the final_logits_bias a seq2seq class adds)")
"""What a job on an encoder-decoder model announces (once, before Ray starts)."""
