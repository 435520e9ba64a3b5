"""Accumulated statistics that are sums over tokens, kept as float64 tensors on any device.

The analyses accumulate one batch at a time on the model's device (no host copy per
layer); a shard's totals go to the host once, when its tables are written. ``merge`` adds field by
field, so it is associative and commutative up to float64 rounding: shards reduce in any order.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from actlake.analysis.engine.device import accumulate  # noqa: F401 - the analyses' import of it
from actlake.analysis.protocol import Analysis


class SumStats(Analysis):
    """Base for analyses that are dataclasses whose tensor fields are sums; other fields (labels) must
    agree on merge."""

    def _tensor_fields(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), torch.Tensor)]

    def merge(self, other):
        dev = self.device
        return dataclasses.replace(self, **{f: getattr(self, f) + getattr(other, f).to(dev) for f in self._tensor_fields()})

    def layer_scratch(self):
        return dataclasses.replace(self, **{f: torch.zeros_like(getattr(self, f)[:1]) for f in self._tensor_fields()})

    @property
    def device(self) -> torch.device:
        return getattr(self, self._tensor_fields()[0]).device

    def to(self, device):
        return dataclasses.replace(self, **{f: getattr(self, f).to(device) for f in self._tensor_fields()})


def zeros(*shape: int, device=None) -> torch.Tensor:
    """A float64 accumulator."""
    return torch.zeros(shape, dtype=torch.float64, device=device)


def np64(t) -> np.ndarray:
    """A float64 host array of an accumulator (tensor on any device, or array)."""
    if isinstance(t, torch.Tensor):
        return t.detach().to("cpu", torch.float64).numpy()
    return np.asarray(t, dtype=np.float64)


def tensor(a: np.ndarray) -> torch.Tensor:
    """A float64 host tensor of an array read back from a table."""
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float64))
