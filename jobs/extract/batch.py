"""A batch on its way through the device: its outputs, its device-side checks, and the wait for them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from actlake.analysis.engine.device import to_host
from actlake.analysis.engine.recorder import AttentionRecorder
from actlake.analysis.protocol import BatchOutputs
from actlake.batching import Window


@dataclass
class BatchResult:
    """One batch's outputs: the host's view of it (:attr:`outputs`), the analyses' statistics (on the model's
    device) and the shard tables' parts of it (host copies complete once the batch was waited for)."""

    outputs: BatchOutputs
    stats: dict
    """{name: Analysis} accumulated over this batch."""
    parts: dict = field(default_factory=dict)
    """{table: ShardTable} this batch's part of each token table."""

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
    """A batch queued on the device by :meth:`~actlake.jobs.extract.driver.Extractor.launch`."""

    batch: list[Window]
    result: BatchResult
    """Complete only once :meth:`passed` returned (its host copies may still be in flight before)."""
    checks: DeviceChecks
    recorder: AttentionRecorder | None = None
    """Kept until the batch is waited for: a recorded layer graph and its buffers stay alive while queued."""

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
