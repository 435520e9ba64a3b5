"""An edited pass that starts where its intervention starts: the layers before hidden state ``a`` are not computed
again (issue 51).

The clean pass leaves a :class:`Snapshot` at each hidden state ``a`` an intervention starts from: a copy of every
analysis's statistics as they stand once the layers before ``a`` are recorded (the attention layers 0…a-1 and the
hidden states 0…a-1), and block ``a - 1``'s output (hidden state ``a``). The edited pass takes a copy of those
statistics and runs the model with the blocks before ``a`` stubbed (:class:`Skipping`): block ``a - 1`` returns the
clean pass's output, which the intervention's hook then edits, and the earlier blocks hand their input on without
computing anything; only the hidden states from ``a`` on reach the analyses. The embeddings are computed again (a
lookup). Whether a model's blocks can be skipped so is checked on each worker's first batch against the full
edited pass (:mod:`~actlake.analysis.engine.forward`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from actlake.analysis.engine.capture import _Hooks


@dataclass
class Snapshot:
    """The clean pass's state at hidden state ``a`` (taken by the hooks of :class:`Snapshots`)."""

    a: int
    stats: dict
    """{name: Analysis} as they stood (copies, never updated again)."""
    sums: object
    """The per-window sums (:class:`~actlake.analysis.engine.window_summary.WindowSums`), a copy."""
    output: object
    """Block ``a - 1``'s output as the model received it (a tensor or a tuple)."""
    shapes: dict = field(default_factory=dict)
    """Block index -> its output's tail (a tuple's items after the hidden state), or None for a tensor."""
    shared: tuple = ()
    """Objects an analysis may refer to that are never copied (the model)."""

    def fresh(self) -> tuple[dict, object]:
        """A copy of the statistics and sums for one edited pass."""
        return _copy((self.stats, self.sums), self.shared)


def _copy(value, shared: tuple):
    """``copy.deepcopy`` that keeps ``shared`` objects (and whatever they hold) as they are."""
    return copy.deepcopy(value, {id(o): o for o in shared})


class Snapshots(_Hooks):
    """Hooks of the clean pass that take a :class:`Snapshot` at each of ``starts`` (hidden states >= 1)."""

    def __init__(self, blocks: list, starts: set[int], stats: dict, sums, shared: tuple = ()):
        self.blocks, self.starts, self.stats, self.sums, self.shared = blocks, sorted(starts), stats, sums, shared
        self.taken: dict[int, Snapshot] = {}
        self.shapes: dict[int, object] = {}

    def _register(self, handles: list) -> None:
        for i in range(max(self.starts, default=0)):  # every block before the last start: its output's structure
            handles.append(self.blocks[i].register_forward_hook(self._hook(i), prepend=True))

    def _hook(self, i: int):
        def hook(module, args, output):
            self.shapes[i] = tuple(output[1:]) if isinstance(output, tuple) else None
            a = i + 1
            if a in self.starts:  # before hidden state a reaches any analysis (this hook runs first)
                stats, sums = _copy((self.stats, self.sums), self.shared)
                self.taken[a] = Snapshot(a, stats, sums, output, dict(self.shapes), self.shared)
        return hook


class FromLayer:
    """A hidden-state consumer that passes on hidden states ``a`` and later only (the earlier ones are in the
    snapshot's statistics already)."""

    def __init__(self, sink, a: int):
        self.sink, self.a = sink, a

    def __call__(self, layer: int, h) -> None:
        if layer >= self.a:
            self.sink(layer, h)


class Skipping:
    """Context manager: the model's blocks before ``snapshot.a`` compute nothing. Block ``a - 1`` returns the clean
    pass's output; the earlier ones return their input in the structure their output had."""

    def __init__(self, blocks: list, snapshot: Snapshot):
        self.blocks, self.snap = blocks, snapshot

    def __enter__(self) -> Skipping:
        for i in range(self.snap.a):
            self.blocks[i].forward = self._stub(i)  # an instance attribute: hooks still run, the class is untouched
        return self

    def __exit__(self, *exc) -> None:
        for i in range(self.snap.a):
            self.blocks[i].__dict__.pop("forward", None)

    def _stub(self, i: int):
        tail = self.snap.shapes.get(i)

        def forward(*args, **kwargs):
            if i == self.snap.a - 1:
                return self.snap.output
            x = args[0] if args else kwargs["hidden_states"]
            return x if tail is None else (x, *tail)
        return forward


def same_statistics(a: dict, b: dict, rtol: float = 1e-6) -> str | None:
    """None when two passes' statistics give the same tables (within ``rtol`` of each column's largest value),
    else the first table that differs."""
    import numpy as np

    for name in a:
        ta, tb = a[name].to_tables(), b[name].to_tables()
        for t in ta:
            x, y = ta[t], tb[t]
            if x.num_rows != y.num_rows or x.column_names != y.column_names:
                return t
            for c in x.column_names:
                u, v = x[c].to_numpy(zero_copy_only=False), y[c].to_numpy(zero_copy_only=False)
                if u.dtype.kind == "f":
                    scale = np.nanmax(np.abs(v), initial=0.0)
                    if not np.allclose(u, v, rtol=0, atol=rtol * max(scale, 1e-30), equal_nan=True):
                        return f"{t}.{c}"
                elif not (u == v).all():
                    return f"{t}.{c}"
    return None
