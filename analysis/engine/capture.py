"""Read q and k as the model uses them, with any attention kernel.

transformers routes every supported architecture's attention through
``ALL_ATTENTION_FUNCTIONS``. We register ``actlake_sdpa`` and ``actlake_eager``:
outside ``recording()`` each is the real kernel, unchanged. While a
:class:`Recorder` is active, each first hands the recorder that layer's post-rotary
``q`` (B, H, T, d_h), ``k`` (B, H_kv, T, d_h), the softmax scale and the model's
attention mask. A recorder that computes the layer's attention weights anyway may
return the attention output (B, H, T, d_h) from them; the SDPA wrapper then returns
it instead of running the kernel a second time (the eager kernel always runs: its
callers may ask for the weights). Nothing is stored between layers unless the
recorder keeps it.
"""

from __future__ import annotations

import contextlib
import sys
from contextvars import ContextVar
from typing import Callable, Protocol

import torch

from actlake.architectures import (attention_calls, blocks, get_path, key_input_module, key_norm_module,
                                  norm_affine_shift, norm_eps, rms_eps, text_config)

_ACTIVE: ContextVar["Recorder | None"] = ContextVar("actlake_recorder", default=None)
PREFIX = "actlake_"


REPLACEABLE_UNLESS = ("position_bias", "cache", "softcap", "s_aux", "sinks")
"""Kernel arguments that change what the kernel computes beyond mask, scale and q k v: with any of them
set, the kernel always runs itself."""


class Recorder(Protocol):
    def on_attention(self, module, query: torch.Tensor, key: torch.Tensor, scaling: float,
                     attention_mask: torch.Tensor | None, is_causal: bool,
                     value: torch.Tensor | None, softcap: float | None = None,
                     sliding_window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor | None:
        """Called once per layer, before the kernel. ``value`` is given when the recorder may return the
        attention output (B, H, T, d_h) in place of the kernel's; return None to let the kernel run.
        ``softcap``: the kernel's attention logit softcapping, or None; ``sliding_window``: the layer's window
        (transformers' convention), or None; ``sinks``: (H,) learned sink logits, one extra column of each
        head's softmax that no key owns (gpt-oss's ``s_aux``), or None."""


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
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        is_causal = kwargs.get("is_causal")  # what SDPA does without a mask; eager then masks nothing
        is_causal = (base == "sdpa" and query.shape[2] > 1
                     and (getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)))
        replaceable = (base == "sdpa" and not module.training and not kwargs.get("dropout")
                       and all(kwargs.get(k) is None for k in REPLACEABLE_UNLESS))
        out = rec.on_attention(module, query, key, scaling, attention_mask, is_causal, value if replaceable else None,
                               softcap=kwargs.get("softcap"), sliding_window=kwargs.get("sliding_window"),
                               sinks=sink_logits(kwargs))
        if getattr(rec, "check", None) is not None:  # the self-checked batch: the kernel runs, for the comparison
            result = kernel(module, query, key, value, attention_mask, **kwargs)
            rec.kernel_output(module, value, result[0])
            if out is None:
                return result
        if out is not None:  # what the model gets is the same whether or not the batch is checked
            return out.to(query.dtype).transpose(1, 2).contiguous(), None  # (B, T, H, d_h), as the kernel returns
        return kernel(module, query, key, value, attention_mask, **kwargs)

    attention.__name__ = f"{PREFIX}{base}"
    return attention


def sink_logits(kwargs: dict) -> torch.Tensor | None:
    """The (H,) learned sink logits a kernel call carries (``s_aux`` in transformers' kernels, ``sinks`` in
    some remote code), or None."""
    for name in ("s_aux", "sinks"):
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


def register() -> None:
    """Register the wrapping attention implementations (idempotent)."""
    from transformers.masking_utils import (
        ALL_MASK_ATTENTION_FUNCTIONS,
        AttentionMaskInterface,
    )
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
    """``id(attention module) -> layer index`` for a loaded model; a hybrid's blocks without one (linear
    attention, recurrent or state-space layers) are left out."""
    return {id(attn): i for i, attn in attention_blocks(model, family)}


def attention_blocks(model, family) -> list[tuple[int, torch.nn.Module]]:
    """(layer index, attention module) of every block that has one at ``family.attention`` (of the class
    ``family.attention_class`` names, where it names one)."""
    out = []
    for i, block in enumerate(blocks(model, family)):
        try:
            module = get_path(block, family.attention)
        except AttributeError:
            continue
        if module is None:  # a hybrid's other blocks may hold None there (Granite 4's Mamba layers)
            continue
        if family.attention_class is None or type(module).__name__ == family.attention_class:
            out.append((i, module))
    return out


class _Hooks:
    """Hooks registered on entering a ``with`` block and removed on leaving it, whatever happens (also
    when registering one failed). Subclasses register in :meth:`_register` and drop per-pass state in
    :meth:`_clear`."""

    def __enter__(self):
        self._handles: list = []
        try:
            self._register(self._handles)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for h in getattr(self, "_handles", ()):
            h.remove()
        self._handles = []
        self._clear()

    def _register(self, handles: list) -> None:
        raise NotImplementedError

    def _clear(self) -> None:
        pass


class LayerInputs(_Hooks):
    """Hooks that keep, per layer of the current forward pass, the key projection's input x
    (B, T, d) until the recorder takes it (``x.pop``: one layer's at a time, not every layer's), and
    the rotary (cos, sin) the attention module received. Use as a context manager:
    hooks are removed on exit, whatever happens."""

    def __init__(self, model, family):
        self.x: dict[int, torch.Tensor] = {}
        self.rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.norm_in: dict[int, torch.Tensor] = {}
        every = blocks(model, family)
        self._targets = [(i, key_input_module(every[i], family), attn, key_norm_module(every[i], family))
                         for i, attn in attention_blocks(model, family)]
        self._eps: dict[int, float] = {}  # per layer: its norm's ε as an RMS over its width has it, found at first use
        self._norms = {i: n for i, _, _, n in self._targets if n is not None}
        self._centred: dict[int, bool] = {}  # per layer: a LayerNorm (r from the centred input), found at first use

    def _register(self, handles: list) -> None:
        for i, proj, attn, norm in self._targets:
            handles.append(proj.register_forward_pre_hook(self._keep_x(i)))
            handles.append(attn.register_forward_pre_hook(self._keep_rope(i), with_kwargs=True))
            own = getattr(attn, "rotary_emb", None)  # RoPE computed inside the attention module (Moshi)
            if isinstance(own, torch.nn.Module):
                handles.append(own.register_forward_hook(self._keep_own_rope(i)))
            if norm is not None:
                handles.append(norm.register_forward_pre_hook(self._keep_norm_input(i)))

    def _clear(self) -> None:
        self.x.clear()
        self.rope.clear()
        self.norm_in.clear()

    def key_scale(self, layer: int, key: torch.Tensor) -> torch.Tensor | None:
        """(B, H_kv, T) float32 1 / r_n of the layer's key norm (r_n: the RMS over the norm's width, per key
        head or over all of them, as the norm module saw its input: (B, T, H_kv d_h), (B, T, H_kv, d_h) or
        (B, H_kv, T, d_h)), or None without a key norm. ``key``: the kernel's k (B, H_kv, T, d_h)."""
        kin = self.norm_in.pop(layer, None)
        if kin is None:
            return None
        B, H, T, _ = key.shape
        kin = kin.detach().float()
        if layer not in self._centred:
            self._centred[layer] = bool(norm_affine_shift(self._norms[layer], kin.shape[-1])[1])
        if self._centred[layer]:  # a LayerNorm: r_n = sqrt(var + eps) (METHODS.md §3 with y - mean(y) for y)
            kin = kin - kin.mean(-1, keepdim=True)
        if layer not in self._eps:  # an L2 norm's ε over the sum of squares is ε / width over their mean
            norm = self._norms[layer]
            self._eps[layer] = norm_eps(norm) if self._centred[layer] else rms_eps(norm, kin.shape[-1])
        r2 = kin.pow(2).mean(-1) + self._eps[layer]  # the norm's own reduction: its last axis
        if r2.dim() == 3 and r2.shape[1] == H and r2.shape[2] == T and r2.shape[1] != T:  # heads first
            return torch.rsqrt(r2)
        r2 = r2.reshape(B, T, -1)  # (B, T, H_kv) per head, (B, T, 1) over all heads
        return torch.rsqrt(r2).expand(B, T, H).permute(0, 2, 1).contiguous()

    def _keep_norm_input(self, i):
        def hook(module, args):
            self.norm_in[i] = args[0]
        return hook

    def _keep_x(self, i):
        def hook(module, args):
            self.x[i] = args[0]
        return hook

    def _keep_own_rope(self, i):
        def hook(module, args, output):
            if isinstance(output, tuple) and len(output) == 2:
                self.rope[i] = output
        return hook

    def _keep_rope(self, i):
        def hook(module, args, kwargs):
            pe = kwargs.get("position_embeddings")
            if isinstance(pe, torch.Tensor):  # complex freqs_cis (Llama 4): one tensor, kept as a pair
                pe = (pe, pe)
            if pe is not None:
                self.rope[i] = pe
        return hook


class HiddenStream(_Hooks):
    """Hooks that hand each hidden state to ``consume(layer, h)`` as the model produces it, so that no
    hidden state outlives the analyses of it (``output_hidden_states`` keeps all L+1 until the forward
    pass returns: L+1 times (B, T, d) of device memory).

    Layers follow Hugging Face's ``hidden_states`` order: 0 is the first block's input (the embeddings),
    ℓ in 1…L-1 the output of block ℓ-1. Hidden state L is the model's ``last_hidden_state`` (after the
    final norm where the model has one), which the caller hands over once the forward pass returns
    (:meth:`last`): the same as ``output_hidden_states`` wherever transformers ties
    ``hidden_states[-1]`` to ``last_hidden_state``, as it does for every supported family
    (``tests/integration/test_hidden_stream.py`` compares them). Use as a context manager: hooks and
    the consumer are dropped on exit, whatever happens."""

    def __init__(self, model, family):
        self._blocks = blocks(model, family)
        self.consume: Callable[[int, torch.Tensor], None] | None = None
        self.calls = attention_calls(text_config(model.config))
        """Call-order layers (blocks run several times per pass, :func:`~actlake.architectures.attention_calls`):
        hidden state 0 is the input of the pass's first block call, k + 1 the output of its k-th (L: as above)."""
        self._called = -1  # block calls so far in this pass; -1 before the first

    @property
    def n_layers(self) -> int:
        return len(self._blocks) if self.calls is None else self.calls

    def __call__(self, consume: Callable[[int, torch.Tensor], None]) -> "HiddenStream":
        self.consume = consume
        return self

    def _register(self, handles: list) -> None:
        if self.calls is not None:
            for block in dict.fromkeys(self._blocks):
                handles.append(block.register_forward_pre_hook(self._call_input, with_kwargs=True))
                handles.append(block.register_forward_hook(self._call_output))
            return
        handles.append(self._blocks[0].register_forward_pre_hook(self._first, with_kwargs=True))
        for i, block in enumerate(self._blocks[:-1]):  # the last block's output is not hidden state L
            handles.append(block.register_forward_hook(self._output_of(i)))

    def _clear(self) -> None:
        self.consume = None  # nor the batch's consumer (its buffers, after an error its half-built sums)
        self._called = -1

    def _call_input(self, module, args, kwargs):
        if self._called < 0:
            self._called = 0
            self._first(module, args, kwargs)

    def _call_output(self, module, args, output):
        self._called += 1
        if self._called >= self.calls:  # the pass's last block call: hidden state L is last_hidden_state
            self._called = -1
            return
        self.consume(self._called, (output[0] if isinstance(output, tuple) else output).detach())

    def last(self, last_hidden_state: torch.Tensor) -> None:
        """Hand over hidden state L (the forward pass's ``last_hidden_state``)."""
        self.consume(self.n_layers, last_hidden_state)

    def _first(self, module, args, kwargs):
        self.consume(0, (args[0] if args else kwargs["hidden_states"]).detach())

    def _output_of(self, i: int):
        def hook(module, args, output):
            self.consume(i + 1, (output[0] if isinstance(output, tuple) else output).detach())
        return hook
