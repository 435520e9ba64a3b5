"""A batch as producers see it (:class:`ModelSpec`, :class:`HiddenBatch`, :class:`BatchOutputs`, part of
:mod:`~actlake.analysis.protocol`), and on its way through the device: its results, its device-side checks,
and the wait for them."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from actlake.analysis.engine.device import to_host
from actlake.analysis.engine.recorder import AttentionRecorder
from actlake.batching import Window


@dataclass(frozen=True)
class ModelSpec:
    """What a producer needs to size its accumulators."""

    n_layers: int
    """Transformer blocks (hidden states: n_layers + 1, 0 = embeddings); the layer axis of attention statistics."""
    n_heads: int
    """Query heads per attention layer (H)."""
    n_kv_heads: int
    """Key/value heads (H_kv; fewer than H with grouped-query attention)."""
    d_model: int
    """Width of the residual stream (d)."""
    max_length: int
    """Tokens per window (tokenization.max_length)."""
    device: torch.device
    """Where the accumulators live while a shard runs (the model's device)."""
    attention_layers: tuple[int, ...] = ()
    """The layers with attention (every one but a hybrid's linear-attention, recurrent or state-space layers,
    which no attention statistic has rows for); empty: all ``n_layers``."""

    @property
    def hybrid(self) -> bool:
        """Some layers have no attention (``attention_layers`` lists fewer than ``n_layers``)."""
        return bool(self.attention_layers) and len(self.attention_layers) < self.n_layers


@dataclass
class HiddenBatch:
    """A batch as :meth:`Producer.add_hidden` sees it. Masks and categories are the host's (B, T) tensors."""

    valid: torch.Tensor
    """(B, T) 1 for real tokens, 0 for padding."""
    role: torch.Tensor
    """(B, T) int64 ``ROLE`` ids (bos, eos, period, comma, other)."""
    type8: torch.Tensor
    """(B, T) int64 ``TYPE8`` ids (newline, whitespace, letters, digits, ...)."""
    strict: bool
    """Look for inf/NaN values as they come (may read the device back). False: count them on the device
    and report them through :meth:`Producer.problems`; the batch is then run again strictly."""
    triton: bool = False
    """The worker uses Triton kernels (:mod:`~actlake.analysis.engine.kernels`; a CUDA device)."""
    windows: list = field(default_factory=list)
    """The batch's :class:`~actlake.batching.Window` s, row by row."""


@dataclass
class LogitsBatch:
    """A pass's output as :meth:`Producer.add_logits` sees it. Masks and ids are the host's (B, T) tensors."""

    head: torch.nn.Module
    """The causal LM's output head: (n, d) final hidden states -> (n, V) next-token logits (with ``device_map`` it
    may live on another device than the hidden states)."""
    transform: object
    """The model's own transform of its logits (scaling, softcapping), to apply in float32, or None."""
    last_hidden: torch.Tensor
    """(B, T, d) the pass's final hidden state (after the final norm), on the model's device."""
    ids: torch.Tensor
    """(B, T) token ids."""
    mask: torch.Tensor
    """(B, T) 1 for real tokens."""
    clean: torch.Tensor | None = None
    """An edited pass: the clean pass's (B, T, d) final hidden state; None for the clean pass."""


@dataclass
class BatchOutputs:
    """A finished batch on the host, as :meth:`ShardTable.collect` sees it (padding included; ``mask`` says
    which tokens are real; windows are right-padded, so a row's real tokens are a prefix)."""

    windows: list
    """(B,) :class:`~actlake.batching.Window` s."""
    ids: torch.Tensor
    """(B, T) token ids."""
    mask: torch.Tensor
    """(B, T) 1 for real tokens."""
    role: torch.Tensor
    """(B, T) int64 ``ROLE`` ids (0 on padding)."""
    type8: torch.Tensor
    """(B, T) int64 ``TYPE8`` ids (0 on padding)."""
    cats: object
    """The worker's :class:`~actlake.categories.Categorizer` (token texts)."""
    surprisal: torch.Tensor | None = None
    """(B, T) float32 -log p(token | earlier tokens), NaN where undefined; None without an LM head."""

    def token_keys(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(doc_id, window_index, position, lengths): the real tokens' keys in (row, position) order, (n,)
        each, and the (B,) window lengths."""
        lengths = np.fromiter((len(w.ids) for w in self.windows), np.int64, len(self.windows))
        n = int(lengths.sum())
        return (np.repeat([w.doc_id for w in self.windows], lengths), np.repeat([w.window for w in self.windows], lengths),
                np.arange(n) - np.repeat(np.cumsum(lengths) - lengths, lengths), lengths)


@dataclass
class BatchResult:
    """One batch's outputs: the host's view of it (:attr:`outputs`), the analyses' statistics (on the model's
    device) and the shard tables' parts of it (host copies complete once the batch was waited for)."""

    outputs: BatchOutputs
    stats: dict
    """{name: Analysis} accumulated over this batch."""
    parts: dict = field(default_factory=dict)
    """{table: ShardTable} this batch's part of each token table."""
    edited: dict = field(default_factory=dict)
    """{intervention: {name: Analysis}}: the statistics of the batch run under each intervention (the clean
    pass's are :attr:`stats`)."""
    window_sums: dict = field(default_factory=dict)
    """With interventions, {pass: (sums, counts)}: (B, K) host arrays per window
    (:mod:`~actlake.analysis.engine.window_summary`), the clean pass's under ``none``."""

    @property
    def batch(self) -> list[Window]:
        return self.outputs.windows

    @property
    def surprisal(self) -> torch.Tensor | None:
        return self.outputs.surprisal


class DeviceChecks:
    """A queued batch's device-side checks and the point after which its host copies are complete.

    One CUDA device: the checks are summed into one pinned host value and an event is recorded behind
    them, when the batch is queued; :meth:`failed` waits for that event only (the batch's only
    synchronisation), so work queued after it (the next batch) goes on. Several devices: every device in
    use is synchronised. On a CPU there is nothing to wait for."""

    def __init__(self, dev: torch.device, checks: list, hidden_devices: set):
        self.checks, self.event, self.flag = checks, None, None
        self.devices = {d for d in {dev} | hidden_devices | {t.device for t in checks} if d.type == "cuda"}
        if len(self.devices) == 1:
            (cuda,) = self.devices
            if checks:
                self.flag = to_host(torch.stack([t.sum().to(torch.float64) for t in checks]).sum())
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(cuda))

    def failed(self) -> bool:
        if self.event is not None:
            self.event.synchronize()
            return self.flag is not None and bool(self.flag)
        for d in self.devices:
            torch.cuda.synchronize(d)
        return any(bool(t.sum()) for t in self.checks)


@dataclass
class Launched:
    """A batch queued on the device by :meth:`~actlake.analysis.engine.forward.ForwardPass.launch`."""

    batch: list[Window]
    result: BatchResult
    """Complete only once :meth:`passed` returned (its host copies may still be in flight before)."""
    checks: DeviceChecks
    recorder: AttentionRecorder | None = None
    """The clean pass's, kept until the batch is waited for: a recorded layer graph and its buffers stay alive while
    queued."""
    edited: list = field(default_factory=list)
    """The edited passes' recorders, kept likewise."""

    def passed(self) -> bool:
        """Wait for the batch; False when a device-side check counted a problem (run it again strictly)."""
        return not self.checks.failed()


class HiddenSink:
    """Hands each hidden state, as the model produces it, to every producer that reads hidden states."""

    def __init__(self, readers: list, hb):
        self.readers, self.hb, self.devices = readers, hb, set()

    def __call__(self, layer: int, h: torch.Tensor) -> None:
        self.devices.add(h.device)
        for x in self.readers:
            x.add_hidden(layer, h, self.hb)
