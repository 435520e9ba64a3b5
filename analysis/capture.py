"""Read q and k as the model uses them, with any attention kernel.

transformers routes every supported architecture's attention through
``ALL_ATTENTION_FUNCTIONS``. We register ``actlake_sdpa`` and ``actlake_eager``:
each calls the real kernel unchanged and, while a :class:`Recorder` is active,
first hands the recorder that layer's post-rotary ``q`` (B, H, T, d_h), ``k``
(B, H_kv, T, d_h) and the softmax scale. Nothing is stored between layers unless
the recorder keeps it. Outside ``recording()`` the wrapper is a pass-through.
"""

from __future__ import annotations

import contextlib
import sys
from contextvars import ContextVar
from typing import Callable, Protocol

import torch

_ACTIVE: ContextVar["Recorder | None"] = ContextVar("actlake_recorder", default=None)
PREFIX = "actlake_"


class Recorder(Protocol):
    def on_attention(self, module, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
        """Called once per layer, before the kernel runs."""


def _base_kernel(name: str, module) -> Callable:
    if name == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[name]


def _make_wrapper(base: str) -> Callable:
    def attention(module, query, key, value, attention_mask, **kwargs):
        kernel = _base_kernel(base, module)
        rec = _ACTIVE.get()
        if rec is None:
            return kernel(module, query, key, value, attention_mask, **kwargs)
        scaling = kwargs.get("scaling")
        rec.on_attention(module, query, key, query.shape[-1] ** -0.5 if scaling is None else scaling)
        return kernel(module, query, key, value, attention_mask, **kwargs)

    attention.__name__ = f"{PREFIX}{base}"
    return attention


def register() -> None:
    """Register the wrapping attention implementations (idempotent)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    for base in ("sdpa", "eager"):
        name = PREFIX + base
        if name not in AttentionInterface._global_mapping:
            AttentionInterface.register(name, _make_wrapper(base))
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])


def install(model: torch.nn.Module) -> None:
    """Switch a loaded model to the wrapping implementation of its current kernel."""
    register()
    current = model.config._attn_implementation or "eager"
    if current.startswith(PREFIX):
        return
    model.set_attn_implementation(PREFIX + current)


@contextlib.contextmanager
def recording(recorder: Recorder):
    """Route every attention call of models run inside the block to ``recorder``."""
    token = _ACTIVE.set(recorder)
    try:
        yield recorder
    finally:
        _ACTIVE.reset(token)


def attention_modules(model, family) -> dict[int, int]:
    """``id(attention module) -> layer index`` for a loaded model."""
    from actlake.architectures import blocks, get_path

    return {id(get_path(block, family.attention)): i for i, block in enumerate(blocks(model, family))}


class LayerInputs:
    """Hooks that keep, per layer of the current forward pass, the key projection's input x
    (B, T, d) and the rotary (cos, sin) the attention module received. Use as a context manager:
    hooks are removed on exit, whatever happens."""

    def __init__(self, model, family):
        from actlake.architectures import blocks, get_path, key_input_module

        self.x: dict[int, torch.Tensor] = {}
        self.rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._targets = [(i, key_input_module(b, family), get_path(b, family.attention)) for i, b in enumerate(blocks(model, family))]
        self._handles: list = []

    def __enter__(self) -> "LayerInputs":
        try:
            for i, proj, attn in self._targets:
                self._handles.append(proj.register_forward_pre_hook(self._keep_x(i)))
                self._handles.append(attn.register_forward_pre_hook(self._keep_rope(i), with_kwargs=True))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.x.clear()
        self.rope.clear()

    def _keep_x(self, i):
        def hook(module, args):
            self.x[i] = args[0]
        return hook

    def _keep_rope(self, i):
        def hook(module, args, kwargs):
            pe = kwargs.get("position_embeddings")
            if pe is not None:
                self.rope[i] = pe
        return hook
