"""Interventions: the residual stream edited at given hidden states, on the tokens an intervention names.

An :class:`Intervention` is plain data (resolved by the driver and each worker from the job's
``interventions:``, :mod:`actlake.jobs.extract.interventions`). :class:`Editing` hooks the model so that hidden
state ``L`` (the input of block ``L``; 0 = the embeddings) is replaced by :meth:`Intervention.edit` of it before
anything reads it: block ``L - 1``'s output is edited by a forward hook that runs before every other hook on that
block (so the hidden-state stream sees the edited state, as the next block does); hidden state 0 by a pre-hook
on block 0. Hooks are removed on exit, whatever happens.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import torch

from actlake.analysis.engine.capture import _Hooks
from actlake.architectures import blocks
from actlake.categories import ROLE


@dataclass(frozen=True)
class Intervention:
    """One intervention, resolved: plain values (a custom one names its function, imported where it runs)."""

    name: str
    layers: tuple[int, ...]
    op: str
    """``zero``, ``mean``, ``scale``, ``add`` or ``project_out``."""
    dims: tuple[int, ...] = ()
    direction: tuple[float, ...] | None = None
    """A vector of the model's width (unit length), or None: ``dims``."""
    value: float = 0.0
    means: tuple[tuple[float, ...], ...] | None = None
    """With ``op: mean``: per entry of ``layers``, each of ``dims``'s mean."""
    tokens: str = "all"
    """``all`` or a token role (:data:`~actlake.categories.ROLE`)."""
    positions: tuple[int, ...] = ()
    """Window positions edited (among ``tokens``); empty: all."""
    function: str | None = None
    """With ``op: custom``: ``package.module:function`` (imported where it runs: :func:`load_function`)."""

    def selected(self, valid: torch.Tensor, role: torch.Tensor) -> torch.Tensor:
        """(B, T) bool: the tokens edited, among the valid ones."""
        out = valid if self.tokens == "all" else valid & (role == ROLE.index(self.tokens))
        if self.positions:
            pos = torch.arange(valid.shape[1], device=valid.device)
            out = out & torch.isin(pos, torch.tensor(self.positions, device=valid.device))[None, :]
        return out

    def edit(self, layer: int, h: torch.Tensor, select: torch.Tensor, batch: "EditBatch | None" = None) -> torch.Tensor:
        """``h`` (B, T, d) with the selected tokens (B, T) edited at hidden state ``layer``."""
        sel = select.to(h.device)[..., None]  # (B, T, 1); with device_map a block may live on another device
        if self.op == "custom":
            out = load_function(self.function)(layer, h.clone(), batch)  # an edit in place cannot reach the model
            if not isinstance(out, torch.Tensor) or out.shape != h.shape:
                from actlake.errors import AnalysisError

                got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise AnalysisError(f"intervention {self.name!r}: {self.function} returned {got} for a hidden state of "
                                    f"shape {tuple(h.shape)}; it must return the edited hidden state, the same shape")
            return torch.where(sel, out.to(h.dtype), h)
        if self.direction is not None:
            u = torch.tensor(self.direction, dtype=h.dtype, device=h.device)  # (d,)
            c = h @ u  # (B, T) the component along u
            new = {"zero": 0.0 * c, "project_out": 0.0 * c, "scale": c * self.value, "add": c + self.value}[self.op]
            return torch.where(sel, h + (new - c)[..., None] * u, h)
        dims = torch.tensor(self.dims, device=h.device)
        x = h[..., dims]  # (B, T, k)
        if self.op == "mean":
            new = torch.tensor(self.means[self.layers.index(layer)], dtype=h.dtype, device=h.device).expand_as(x)
        else:
            new = {"zero": torch.zeros_like(x), "scale": x * self.value, "add": x + self.value}[self.op]
        out = h.clone()
        out[..., dims] = torch.where(sel, new, x)
        return out


@dataclass
class EditBatch:
    """What a custom intervention's function is given besides the layer and the hidden state."""

    valid: torch.Tensor
    """(B, T) bool: real tokens (False on padding), on the hidden state's device."""
    role: torch.Tensor
    """(B, T) :data:`~actlake.categories.ROLE` ids."""
    selected: torch.Tensor
    """(B, T) bool: the tokens the intervention's ``tokens`` and ``positions`` select (only these are taken)."""
    windows: list = field(default_factory=list)
    """The batch's :class:`~actlake.batching.Window` s, row by row."""


def load_function(target: str):
    """``package.module:function`` -> the function (ConfigError naming it when it cannot be imported or called)."""
    from actlake.errors import ConfigError

    module, _, attr = target.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"interventions: cannot import '{target}' ({type(e).__name__}: {e})") from None
    if not callable(fn):
        raise ConfigError(f"interventions: '{target}' is not a function")
    return fn


class Editing(_Hooks):
    """Context manager: ``intervention`` applied to every forward pass of ``model`` inside it, on the tokens
    ``select`` (B, T) of the batch run."""

    def __init__(self, model, family, intervention: Intervention, select: torch.Tensor, batch: EditBatch | None = None):
        self.blocks = blocks(model, family)
        self.iv, self.select, self.batch = intervention, select, batch

    def _register(self, handles: list) -> None:
        for layer in self.iv.layers:  # first among each block's hooks: every reader sees the edited state
            if layer == 0:
                handles.append(self.blocks[0].register_forward_pre_hook(self._pre, with_kwargs=True, prepend=True))
            else:
                handles.append(self.blocks[layer - 1].register_forward_hook(self._post(layer), prepend=True))

    def _pre(self, module, args, kwargs):
        if args:
            return (self.iv.edit(0, args[0], self.select, self.batch), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": self.iv.edit(0, kwargs["hidden_states"], self.select, self.batch)}

    def _post(self, layer: int):
        def hook(module, args, output):
            if isinstance(output, tuple):
                return (self.iv.edit(layer, output[0], self.select, self.batch), *output[1:])
            return self.iv.edit(layer, output, self.select, self.batch)
        return hook
