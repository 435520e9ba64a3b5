"""Moving tensors between the host and the model's device without stalling the device.

On CUDA, host -> device copies go through pinned memory with ``non_blocking=True`` and device ->
host copies land in pinned buffers, also without blocking: the host reads them only after the one
synchronisation point of a batch (see :meth:`actlake.analysis.engine.forward.ForwardPass.run_batch`). On a CPU
every function here is the identity (or a plain copy), so CPU code paths are unchanged.
"""

from __future__ import annotations

import contextlib

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` (on the host) on ``device``; on CUDA through pinned memory, without blocking the host."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type == "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host. From CUDA: an asynchronous copy into pinned memory, valid only after the
    device is next synchronised (reading it earlier reads garbage)."""
    if t.device.type != "cuda":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t, non_blocking=True)


@contextlib.contextmanager
def tf32(enabled: bool):
    """TF32 for float32 matrix products on CUDA on (``enabled``) or off inside, as before outside.
    Off: full float32 for products whose inputs TF32 would round (sums of the model's values) while the
    analyses of a 16-bit model run with it on (:func:`actlake.analysis.engine.recorder.tf32_when_exact`)."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def accumulate(targets: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """``targets[i] += values[i]`` for every i, as one operation (``torch._foreach_add_``: one kernel
    launch for all of them on a GPU, where the analyses' many small sums are launch-bound). Values are
    moved to their target's device (with device_map a layer may live on another GPU than the
    accumulators) and dtype."""
    torch._foreach_add_(targets, [v.to(t.device, t.dtype) for t, v in zip(targets, values, strict=True)])
