"""Load a Hugging Face model and tokenizer for analysis, safely and once per worker."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from actlake.architectures import Family, family_for
from actlake.config import ModelConfig, resolve_model_path
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


def pick_device(cfg: ModelConfig) -> torch.device:
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ModelLoadError("model.device is 'cuda' but this worker sees no GPU")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

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
    family = family_for(hf_config.model_type)
    if lm_head and not family.causal:
        raise ModelLoadError(f"model {path}: surprisal needs a causal LM, and {hf_config.model_type} is not one "
                             "(set analyses.surprisal: false)")
    want_head = family.causal if lm_head is None else lm_head
    device = pick_device(cfg)
    kwargs = dict(common, attn_implementation=cfg.attn_implementation, use_safetensors=None if cfg.allow_pickle else True)
    kwargs["dtype"] = "auto" if cfg.dtype == "auto" else DTYPES[cfg.dtype]
    if cfg.device_map:
        kwargs["device_map"] = cfg.device_map
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **common)
        head = None
        if want_head:
            full = AutoModelForCausalLM.from_pretrained(path, **kwargs)
            model, head = full.base_model, full.get_output_embeddings()
        else:
            model = AutoModel.from_pretrained(path, **kwargs)
    except Exception as e:
        raise ModelLoadError(f"model {path}: cannot load ({type(e).__name__}: {e})") from None
    if not cfg.device_map:
        model.to(device)
        if head is not None:
            head.to(device)
    model.eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    return LoadedModel(model, tokenizer, family, device, path, head)
