"""Load a Hugging Face model and tokenizer for analysis, safely and once per worker."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from actlake.architectures import Family, check_config, check_loaded, logit_transform
from actlake.config import ModelConfig, max_memory_map, resolve_model_path
from actlake.errors import ConfigError, ModelLoadError

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    family: Family
    device: torch.device
    path: str
    lm_head: torch.nn.Module | None = None
    """The output embedding of a causal LM (loaded when surprisal is wanted), else None."""
    placement: dict | None = None
    """With ``model.device_map``: where each module went (transformers' ``hf_device_map``: a GPU index,
    ``cpu`` or ``disk``), else None."""
    offload_folder: str | None = None
    """This worker's own folder of weights offloaded to disk (``model.offload_folder``), else None."""
    causal_lm: torch.nn.Module | None = None
    """The whole causal LM (its own forward pass gives the logits the self-check compares surprisal with)."""
    logit_transform: object = None
    """The model's transform of its output logits (scaling, softcapping) as a function, or None."""

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the weights were loaded in."""
        return self.model.dtype

    def close(self) -> None:
        """Remove this worker's offload folder, if any (the model cannot run afterwards)."""
        if self.offload_folder:
            shutil.rmtree(self.offload_folder, ignore_errors=True)


def pick_device(cfg: ModelConfig) -> torch.device:
    """The device the model runs on (without ``device_map``; with it, :func:`main_device` after loading)."""
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ModelLoadError("model.device is 'cuda' but this worker sees no GPU")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_dtype(cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """``model.dtype`` as a torch dtype. ``auto``: bfloat16 on a GPU with native bfloat16 (compute
    capability 8.0 or newer), float32 on a CPU or an older GPU. With ``device_map``, the worker's GPUs
    decide (none: float32)."""
    if cfg.dtype != "auto":
        return DTYPES[cfg.dtype]
    on_gpu = device.type == "cuda" or (cfg.device_map is not None and torch.cuda.is_available() and cfg.device != "cpu")
    if on_gpu and torch.cuda.is_bf16_supported(including_emulation=False):
        return torch.bfloat16
    return torch.float32


ACCELERATE_HINT = "pip install accelerate  (or reinstall actlake: it depends on it)"


def require_accelerate(cfg: ModelConfig) -> None:
    """ConfigError naming ``model.device_map`` and the install command when it is set and accelerate
    (which places the layers) is missing; call it before starting Ray."""
    if cfg.device_map and importlib.util.find_spec("accelerate") is None:
        raise ConfigError(f"model.device_map: {cfg.device_map!r} needs the accelerate package, which is not installed "
                          f"here: {ACCELERATE_HINT}")


def main_device(model: torch.nn.Module, fallback: torch.device) -> torch.device:
    """Where a model placed with ``device_map`` takes its inputs and hands back its outputs: its first
    GPU, or the CPU when every layer sits in CPU memory or on disk (accelerate's rule)."""
    placed = getattr(model, "hf_device_map", None)
    if not placed:
        return fallback
    gpus = [d for d in placed.values() if d not in ("cpu", "disk")]
    if not gpus:
        return torch.device("cpu")
    first = gpus[0]
    return torch.device("cuda", first) if isinstance(first, int) else torch.device(first)


def _placement_kwargs(cfg: ModelConfig) -> dict:
    """from_pretrained's ``device_map`` / ``max_memory`` / ``offload_folder`` for this config. Without
    ``model.device_map``: the whole model onto its GPU, or nothing on a CPU. The offload folder is a fresh
    subfolder per worker."""
    if not cfg.device_map:
        device = pick_device(cfg)
        # straight onto the GPU as each tensor is read, never the whole model in host memory first
        return {"device_map": {"": str(device)}} if device.type == "cuda" else {}
    require_accelerate(cfg)
    kw: dict = {"device_map": cfg.device_map}
    if cfg.max_memory:
        kw["max_memory"] = max_memory_map(cfg.max_memory)
    if cfg.offload_folder:
        try:
            os.makedirs(cfg.offload_folder, exist_ok=True)
            kw["offload_folder"] = tempfile.mkdtemp(prefix="actlake-offload-", dir=cfg.offload_folder)
        except OSError as e:
            raise ModelLoadError(f"model.offload_folder: cannot write in {cfg.offload_folder} ({e.strerror or e})") from None
    return kw


def _check_weights(folder: Path, allow_pickle: bool) -> None:
    names = os.listdir(folder)
    has_safe = any(n.endswith(".safetensors") or n == "model.safetensors.index.json" for n in names)
    has_pickle = any(n.endswith((".bin", ".pt", ".pth", ".ckpt")) for n in names)
    if not has_safe and has_pickle and not allow_pickle:
        raise ModelLoadError(
            f"{folder}: only pickle weights (.bin) found; pickle can run code when loaded. "
            "Convert to safetensors, or set model.allow_pickle: true if you trust the file"
        )
    if not has_safe and not has_pickle:
        raise ModelLoadError(f"{folder}: no weight files (*.safetensors) found")


def load_model(cfg: ModelConfig, lm_head: bool | None = False) -> LoadedModel:
    """Load tokenizer and base model as the config says; never loads pickle weights by default.

    ``lm_head``: also load the causal-LM head (``AutoModelForCausalLM``; the base model is then its
    ``base_model``); None: when the family is causal. True for a non-causal family is an error.
    """
    from transformers import (
        AutoConfig,
        AutoModel,
        AutoModelForCausalLM,
        AutoTokenizer,
    )

    try:
        path = resolve_model_path(cfg.name_or_path)
    except ConfigError as e:
        raise ModelLoadError(str(e)) from None
    local = os.path.isdir(path)
    if local:
        _check_weights(Path(path), cfg.allow_pickle)
    elif cfg.revision is None:
        log.warning("model %s: no model.revision pinned; the hub may serve different weights next time", path)
    common = dict(revision=None if local else cfg.revision, trust_remote_code=cfg.trust_remote_code)
    try:
        hf_config = AutoConfig.from_pretrained(path, **common)
    except Exception as e:
        raise ModelLoadError(f"model {path}: cannot read its config ({type(e).__name__}: {e})") from None
    family = check_config(hf_config)
    if lm_head and not family.causal:
        raise ModelLoadError(f"model {path}: surprisal needs a causal LM, and {hf_config.model_type} is not one "
                             "(set analyses.surprisal: false)")
    want_head = family.causal if lm_head is None else lm_head
    causal = want_head or family.decoder_alone  # an encoder-decoder model: its decoder, the type's causal LM
    device = pick_device(cfg)
    attn = attention_implementation(cfg.attn_implementation, hf_config)
    kwargs = dict(common, attn_implementation=attn, use_safetensors=None if cfg.allow_pickle else True)
    # weights are read straight into the target dtype (and, with device_map, onto their devices)
    kwargs.update(_placement_kwargs(cfg), dtype=resolve_dtype(cfg, device))
    try:
        with _no_progress_bars():
            tokenizer = AutoTokenizer.from_pretrained(path, **common)
            head = None
            if causal:
                full, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **kwargs)
                shared = _shared_embeddings(info) if family.decoder_alone else None
                if shared:  # a seq2seq checkpoint: the decoder's embeddings are its shared ones
                    del full
                    full, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True,
                                                                      key_mapping=shared, **kwargs)
                model, head = base_of(full), output_head(full)
                if _multimodal_instead(full, model, family, info, hf_config):  # Emu3: its text LM cannot map the keys
                    from transformers import AutoModelForImageTextToText

                    del full, model, head
                    full, info = AutoModelForImageTextToText.from_pretrained(path, output_loading_info=True, **kwargs)
                    model, head = base_of(full), output_head(full)
            else:
                model, info = AutoModel.from_pretrained(path, output_loading_info=True, **kwargs)
    except Exception as e:
        hint = " (set model.offload_folder)" if "offload_folder" in str(e) and not cfg.offload_folder else ""
        raise ModelLoadError(f"model {path}: cannot load ({type(e).__name__}: {e}){hint}") from None
    check_loaded(full if causal else model, model, family, info.get("missing_keys"), path, head=bool(want_head))
    if not want_head:
        head = None
    placement = None
    if cfg.device_map:
        placement = dict(getattr(model if head is None else full, "hf_device_map", None) or {})
        device = main_device(model if head is None else full, device)
        log.info("model %s placed by device_map %r: %s; inputs on %s", path, cfg.device_map, placement, device)
    else:
        model.to(device)
        if head is not None:
            head.to(device)
    model.eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    return LoadedModel(model, tokenizer, family, device, path, head, placement, kwargs.get("offload_folder"),
                       full if head is not None else None, logit_transform(family, hf_config) if head is not None else None)


SHARED = "model.shared.weight"
"""Where a seq2seq checkpoint (BART's ``BartForConditionalGeneration``) keeps the embeddings its encoder, decoder and
output head share; the type's causal LM reads the decoder's at ``model.decoder.embed_tokens.weight``."""


def _shared_embeddings(info) -> dict | None:
    """from_pretrained's ``key_mapping`` that reads a seq2seq checkpoint's shared embeddings as the decoder's, where
    loading its decoder alone left those missing and the checkpoint has them (None otherwise); the output head, where
    it is tied to them, follows. A head still missing then is refused by :func:`check_loaded`."""
    missing = [k for k in info.get("missing_keys") or () if k.endswith("decoder.embed_tokens.weight")]
    if len(missing) != 1 or SHARED not in set(info.get("unexpected_keys") or ()):
        return None
    return {f"^{re.escape(SHARED)}$": missing[0]}


def _multimodal_instead(full, model, family, info, hf_config) -> bool:
    """Whether the causal LM transformers picked for a multimodal checkpoint left weights of its blocks random (its text
    model does not map the checkpoint's keys: Emu3) and the type has a multimodal class to load it with instead."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    if type(hf_config) not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING or full.config.model_type == hf_config.model_type:
        return False
    try:
        check_loaded(full, model, family, info.get("missing_keys"), "")
    except ModelLoadError:
        return True
    return False


def output_head(full) -> torch.nn.Module:
    """The causal LM's map from the final hidden state to the logits: its output embedding, after the prediction
    head a model applies first where it has one besides it (``lm_head`` then ``decoder``: ModernBERT-decoder). The
    first batch's self-check compares the surprisal it gives with the model's own logits."""
    out = full.get_output_embeddings()
    pre = getattr(full, "lm_head", None)
    if not isinstance(pre, torch.nn.Module) or pre is out or isinstance(pre, torch.nn.Linear):
        return out
    head = torch.nn.Sequential(pre, out)
    head.out_features = out.weight.shape[0]  # the vocabulary (token_surprisal's chunking reads it)
    return head


@contextlib.contextmanager
def _no_progress_bars():
    """transformers' "Loading weights" bar off while a model loads: in a Ray worker it reaches the user's
    console through Ray's log forwarding, one interleaved bar per worker."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def base_of(full):
    """The base model inside a model with a head (``base_model``; ``model`` where the class's
    ``base_model_prefix`` names no attribute of it, as for Llama 4's text-only model)."""
    base = full.base_model
    return getattr(full, "model", full) if base is full else base


def attention_implementation(requested: str, hf_config) -> str:
    """``model.attn_implementation`` for this model: ``eager`` where transformers runs the family with eager
    attention only (Gemma 2, which it refuses with sdpa) or the config caps attention logits (SDPA has no
    softcapping), logged; else as asked."""
    if requested != "sdpa":
        return requested
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    cls = MODEL_MAPPING.get(type(hf_config), None)
    why = ("transformers runs it with eager attention only" if cls is not None and not getattr(cls, "_supports_sdpa", True)
           else "its attention logits are softcapped, which SDPA does not do"
           if getattr(hf_config, "attn_logit_softcapping", None) else None)
    if why:
        log.warning("model_type %r: %s; using attn_implementation eager", hf_config.model_type, why)
        return "eager"
    return requested
