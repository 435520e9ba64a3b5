"""One batch's attention analyses recorded at one layer and replayed at the others (``analyses.layer_graphs``).

Every attention layer of a batch runs the same operations on tensors of the same shapes: only q, k, v,
the key projection's input x and W_K, b_K change from layer to layer. On a GPU the host's time to issue
those operations (about a hundred small ones per layer) bounds the suite, not the device's. So the
recorder runs the batch's first attention layer as usual (which computes the batch's facts once and
compiles any kernel), records the second as a CUDA graph whose inputs are fixed buffers, and at every
later layer copies that layer's tensors into the buffers and replays the graph: a handful of launches
instead of a hundred. The analyses write a one-layer copy of their accumulators
(:meth:`~actlake.analysis.protocol.Analysis.layer_scratch`, zeroed by the graph itself), which is added
into their ``[layer]`` after each replay.

On a CPU the same recording runs through torch.fx (``make_fx``): the operations are traced once and the
trace is what runs at the later layers, with what CUDA capture forbids (reading a value back to the
host, making a tensor from host data) refused while tracing. It is not faster; it is how the tests check,
without a GPU, that what the analyses compute at a replayed layer is that layer's and not the recorded one's.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from actlake.analysis.engine.device import accumulate
from actlake.errors import AnalysisError

Inputs = dict  # name -> tensor or None: what changes from layer to layer


def tensor_fields(a) -> list[str]:
    return [k for k, v in vars(a).items() if isinstance(v, torch.Tensor)]


class LayerReplay:
    """For one batch: records the attention analyses of one layer, then replays them at the others.

    ``analyses``: the batch's attention analyses, every one :attr:`~actlake.analysis.protocol.Analysis.graph_safe`.
    The recorded function gets the fixed input buffers and the consumers to call (the scratch copies'
    ``add_layer``, at layer 0) and returns the attention output or None."""

    def __init__(self, analyses: list):
        unsafe = [a.name for a in analyses if not a.graph_safe]
        if unsafe:
            raise AnalysisError(f"analyses.layer_graphs: {unsafe} are not graph_safe")
        self.analyses = analyses
        self.scratch = [a.layer_scratch() for a in analyses]
        self.fields = [(a, s, f) for a, s in zip(analyses, self.scratch) for f in tensor_fields(s)]
        self.consumers = [s.add_layer for s in self.scratch]
        self.static: Inputs | None = None
        self.key = None
        self._run: Callable | None = None
        self.graph = None  # the CUDA graph (kept alive with the batch) or the fx trace
        self.replays = 0

    @staticmethod
    def signature(inputs: Inputs, extra) -> tuple:
        return extra, tuple((k, None) if v is None else (k, v.shape, v.dtype, v.device) for k, v in inputs.items())

    def fits(self, inputs: Inputs, extra) -> bool:
        """Whether the recorded graph can serve a layer with these inputs (and ``extra``: what else it baked in)."""
        return self.static is not None and self.key == self.signature(inputs, extra)

    @property
    def device(self) -> torch.device | None:
        """Where the analyses' accumulators (and their scratch copies) live: the only device a layer can be
        recorded and replayed on (a model spread over GPUs runs its other layers as they are)."""
        return getattr(self.fields[0][1], self.fields[0][2]).device if self.fields else None

    def record(self, inputs: Inputs, extra, run: Callable[[Inputs, list], torch.Tensor | None], keep=()) -> None:
        """Record ``run(fixed inputs, consumers)``; it does not run yet (:meth:`replay` does). ``keep``: what
        the recording reads besides its inputs (tensors it was handed once per forward pass), held as long
        as the recording is."""
        self.static = {k: None if v is None else _same_layout(v) for k, v in inputs.items()}
        self._kept = keep
        zero = [getattr(s, f) for _, s, f in self.fields]

        def body():
            torch._foreach_zero_(zero)
            out = run(self.static, self.consumers)
            return () if out is None else (out,)

        try:
            self._run = self._cuda(body) if self._device.type == "cuda" else self._fx(body)
        except torch.OutOfMemoryError:
            self.static = None
            raise  # the batch is split (Extractor): not the recording's fault
        except Exception as e:  # noqa: BLE001 - whatever the capture refused, named with the key that asked for it
            self.static = None
            raise AnalysisError(f"recording a layer's analyses failed ({type(e).__name__}: {e}); "
                                "set analyses.layer_graphs: false") from e
        self.key = self.signature(inputs, extra)

    @property
    def _device(self) -> torch.device:
        return next(v.device for v in self.static.values() if v is not None)

    def _cuda(self, body) -> Callable:
        dev = self._device
        main, side = torch.cuda.current_stream(dev), _thread.stream(dev)
        side.wait_stream(main)  # the inputs' copies and everything before this layer
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(dev), torch.cuda.stream(side):
            if dev not in _thread.warm:
                body()
                _thread.warm.add(dev)
            # a private memory pool per recording, released with its graph: a pool id shared by recordings
            # trips the allocator's `use_count > 0` assertion once every graph that used it is gone
            try:
                graph.capture_begin(capture_error_mode="thread_local")  # other threads may use CUDA meanwhile
                out = body()
            except BaseException:
                with contextlib.suppress(Exception):  # the capture's own error, not the one ending it
                    graph.capture_end()
                with contextlib.suppress(Exception):  # torch 2.11 leaves it open when capture_end raises (#180395)
                    torch._C._cuda_endAllocateToPool(dev.index, graph.pool())
                raise
            graph.capture_end()
        main.wait_stream(side)
        self.graph = graph

        def run():
            graph.replay()  # on the current stream, after this layer's input copies
            return out
        return run

    def _fx(self, body) -> Callable:
        from torch.fx.experimental.proxy_tensor import make_fx  # torch.fx tracing (CPU only): imported when used

        names = [k for k, v in self.static.items() if v is not None]
        values = [self.static[k] for k in names]

        def traced(*ts):
            for k, t in zip(names, ts):  # the trace's placeholders stand for the buffers
                self.static[k] = t
            try:
                return body()
            finally:
                self.static.update(zip(names, values))

        with _NoHostTraffic():
            gm = make_fx(traced)(*values)
        self.graph = gm
        return lambda: gm(*values)

    def replay(self, layer: int, inputs: Inputs) -> torch.Tensor | None:
        """The recorded analyses on ``inputs`` (shaped as recorded), added into the analyses at ``layer``.
        The attention output it returns (when the analyses replace the kernel's) is the recording's own
        buffer, overwritten by the next replay: the model reads it before its next layer starts."""
        src = [v for v in inputs.values() if v is not None]
        torch._foreach_copy_([self.static[k] for k, v in inputs.items() if v is not None], src)
        out = self._run()
        accumulate([getattr(a, f)[layer] for a, _, f in self.fields], [getattr(s, f)[0] for _, s, f in self.fields])
        self.replays += 1
        return out[0] if out else None


def _same_layout(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its strides (a slice of a fused projection keeps its gaps): the recording sees
    what the eager layers saw, so no kernel specialised on layout compiles while capturing. An expanded
    tensor (stride 0: one element seen at several places) cannot be written into: its copy is contiguous."""
    if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        return t.clone(memory_format=torch.contiguous_format)
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)


class _PerThread(threading.local):
    """Per thread and device: the stream recordings are captured on (a capture needs one other than the
    current stream), and whether the analyses ran once on that stream outside a capture (libraries'
    lazy set-up per stream and thread, such as cuBLAS workspaces, cannot happen inside one)."""

    def __init__(self):
        self.streams, self.warm = {}, set()

    def stream(self, dev: torch.device):
        if dev not in self.streams:
            self.streams[dev] = torch.cuda.Stream(dev)
        return self.streams[dev]


_thread = _PerThread()


class _NoHostTraffic:
    """While tracing: refuse what a CUDA graph cannot hold (reading a device value on the host, a
    tensor made from host data), which on a CPU would otherwise trace silently into a constant."""

    REFUSED = ("aten._local_scalar_dense", "aten.lift_fresh", "aten.lift_fresh_copy")

    def __enter__(self):
        refused = self.REFUSED

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if str(func.overloadpacket) in refused:
                    raise AnalysisError(f"{func} while recording a layer: a replayed layer would reuse the recorded "
                                        "layer's value (a CUDA graph cannot record it)")
                return func(*args, **(kwargs or {}))

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)
