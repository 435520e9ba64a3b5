"""Issue 16, item 2 on a CPU: queuing a batch (:meth:`ForwardPass.launch`, the GPU's non-strict path) makes the
host wait for the model's device nowhere beyond where the model's own forward pass does.

A CPU has no device to wait for, so the test follows values instead: every tensor that would live on the
GPU (the model's parameters and buffers, whatever ``to_device`` returns, and everything computed from
those) is marked, and every operation on a marked tensor that would make the host wait for a GPU is
recorded with the line that made it: a read of a value (``.item()``, ``bool()``, ``float()``,
``.tolist()``, ``.numpy()``, ``.cpu()``) or an operation whose output shape depends on the values
(``nonzero``, boolean-mask indexing, ``unique``, ``masked_select``, ...). Not seen: ``.to(device)`` to a
host device not named "cpu" (on a CPU it looks like ``.to(model device)``), and the branches only a GPU
takes (FlashAttention, the Triton kernels, the segmented maxima): ``benchmarks/gpu_suite.py`` counts the
synchronisations on a GPU.
"""

from __future__ import annotations

import os
import sys
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from actlake.analysis.engine import device as device_mod
from actlake.jobs.extract.driver import Extractor
from actlake.model import load_model
from tests.conftest import FAMILIES, job_config
from tests.integration.test_layer_replay import ReadsBack, _windows

pytestmark = pytest.mark.integration

aten = torch.ops.aten
VALUE_SHAPED = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
                aten.unique_consecutive.default, aten.repeat_interleave.Tensor, aten._local_scalar_dense.default,
                aten.item.default, aten.is_nonzero.default, aten.equal.default, aten.bincount.default,
                aten.histc.default}
"""ATen operations that wait for a CUDA device: a value read (item, bool, int, float, equal; under inference
mode ``item`` and ``is_nonzero`` arrive as they are, else as ``_local_scalar_dense``) or an output
whose shape depends on the values."""
READS = {"tolist", "numpy", "cpu", "__array__"}
"""Tensor methods that copy values to the host and read them (on CUDA a blocking copy)."""
TORCH_DIR = os.path.dirname(torch.__file__)


class HostReads:
    """Marks device tensors and records what would wait for them; use ``with HostReads(model) as reads``,
    then ``reads.sites``: one (operation, file:line of the innermost caller outside torch) per wait."""

    def __init__(self, model: torch.nn.Module):
        self.on_device = WeakIdKeyDictionary()
        for t in [*model.parameters(), *model.buffers()]:
            self.on_device[t] = True
        self.sites: list[tuple[str, str]] = []
        outer = self

        class Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
                marked = any(t in outer.on_device for t in tensors)
                if marked and (func in VALUE_SHAPED or _bool_indexed(func, args)):
                    outer.record(str(func))
                out = func(*args, **kwargs)
                if marked:
                    outer.mark_all(out)
                return out

        class Function(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = getattr(func, "__name__", "")
                self_t = args[0] if args and isinstance(args[0], torch.Tensor) else None
                if self_t is not None and self_t in outer.on_device:
                    if name in READS or (name == "to" and _to_host_by_name(args[1:], kwargs)):
                        outer.record(f"Tensor.{name}")
                return func(*args, **kwargs)

        self.modes = (Function(), Dispatch())

    def record(self, op: str) -> None:
        frames = [f for f in traceback.extract_stack()[:-2]
                  if not f.filename.startswith(TORCH_DIR) and f.name not in ("__torch_dispatch__", "__torch_function__")]
        f = frames[-1]
        self.sites.append((op, f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"))

    def mark_all(self, out) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.on_device[t] = True

    def mark(self, t: torch.Tensor) -> torch.Tensor:
        self.on_device[t] = True
        return t

    def __enter__(self):
        for m in self.modes:
            m.__enter__()
        return self

    def __exit__(self, *exc):
        for m in reversed(self.modes):
            m.__exit__(*exc)


def _to_host_by_name(args, kwargs) -> bool:
    """.to("cpu") without non_blocking: a blocking copy to the host on a GPU. Only the name tells it from
    .to(device) on a CPU, where the model's device is the host."""
    named = "cpu" in [a for a in (*args, kwargs.get("device")) if isinstance(a, str)]
    return named and not kwargs.get("non_blocking", False)


def _bool_indexed(func, args) -> bool:
    """x[mask] and x[mask] = v with a boolean mask: the selected count is read from the device."""
    if func not in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default):
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] or ())


@pytest.fixture
def marked_to_device(monkeypatch):
    """Every module's ``to_device`` returns a fresh tensor (on a CPU it would return its argument, which may
    be a host tensor the host goes on reading), marked as on the device by the active :class:`HostReads`."""
    active: list[HostReads] = []
    original = device_mod.to_device

    def to_device(t, device):
        out = original(t, device)
        if active:
            out = active[-1].mark(out.clone() if out is t else out)
        return out

    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("actlake") and getattr(mod, "to_device", None) is original:
            monkeypatch.setattr(mod, "to_device", to_device)
    return active


def _extractor(path, tmp_path, **analyses):
    overrides = {f"analyses.{k}": v for k, v in analyses.items()}
    overrides["activations.layers"] = [1]  # the activation store too (every window sampled: fraction 1)
    cfg = job_config(path, tmp_path, tmp_path / "out", **overrides)
    ex = Extractor(cfg, load_model(cfg.model, lm_head=cfg.analyses.surprisal))  # as a worker loads it
    ex.forward.checked = True  # a worker's later batches: the first is self-checked (tests/integration/test_families.py)
    return ex


def _sites(ex: Extractor, active: list, run) -> list[tuple[str, str]]:
    with HostReads(ex.lm.model) as reads:
        active.append(reads)
        try:
            run()
        finally:
            active.pop()
    return reads.sites


FUSED = {"attention_weights": "fused", "contributions": {"weighted": False}, "attention_by_distance": False}


@pytest.mark.parametrize("options", [{"contributions": {"by_query_category": True}}, FUSED], ids=["explicit", "fused"])
@pytest.mark.parametrize("family", [*FAMILIES, "minilm"])
def test_launching_a_batch_reads_back_only_what_the_plain_forward_pass_reads(family, options, deep_tiny_models,
                                                                             minilm_path, tmp_path, marked_to_device):
    from actlake.batching import collate

    path = minilm_path if family == "minilm" else deep_tiny_models[family]
    ex = _extractor(path, tmp_path, **options)
    with torch.inference_mode():
        for lengths in [(13, 7, 10), (9, 9, 4, 12)]:  # the second batch meets warm caches
            windows = _windows(ex.lm, lengths)
            ids, mask = collate(windows, ex.lm.tokenizer.pad_token_id)
            plain = _sites(ex, marked_to_device, lambda: ex.lm.model(
                input_ids=device_mod.to_device(ids, "cpu"), attention_mask=device_mod.to_device(mask, "cpu"),
                use_cache=False))
            launched = []
            suite = _sites(ex, marked_to_device, lambda: launched.append(ex.forward.launch(windows, strict=False)))
            assert launched[0].passed()
            assert sorted(suite) == sorted(plain), f"{family}, batch of {lengths}: the suite's own waits " \
                f"{sorted(set(suite) - set(plain))} (the model's: {sorted(set(plain))})"
    result = launched[0].result
    assert result.parts["residual_norms"].norms is not None and result.parts["activations"].acts  # residual norms and the activation store ran
    assert (result.surprisal is not None) == (family not in ("bert", "minilm"))


class ListsBack(ReadsBack):  # ReadsBack: float(lq.query.sum()) per layer
    name = "lists_back"

    def add_layer(self, lq) -> None:
        self.total[lq.layer] += len(lq.query.sum((0, 1, 2)).tolist())


class CopiedToHost(ReadsBack):
    name = "copied_to_host"

    def add_layer(self, lq) -> None:
        self.total[lq.layer] += lq.query.to("cpu").sum().double()


class MaskIndexed(ReadsBack):
    name = "mask_indexed"

    def add_layer(self, lq) -> None:
        self.total[lq.layer] += lq.query[lq.query > 0].sum().double()  # as many values as are positive


@pytest.mark.parametrize("cls, op", [(ReadsBack, "aten.item.default"), (ListsBack, "Tensor.tolist"),
                                     (CopiedToHost, "Tensor.to"), (MaskIndexed, "aten.index.Tensor")])
def test_a_read_back_in_an_analysis_is_found(cls, op, deep_tiny_models, tmp_path, marked_to_device):
    """The controls: an analysis that waits for the device at every layer is caught there, at its own line."""
    ex = _extractor(deep_tiny_models["llama"], tmp_path, custom=[{"analysis": f"{cls.__module__}:{cls.__name__}"}],
                    dim_moments=False, residual_norms=False)
    windows = _windows(ex.lm)
    with torch.inference_mode():
        sites = _sites(ex, marked_to_device, lambda: ex.forward.launch(windows, strict=False))
    mine = [s for s in sites if os.path.basename(__file__) in s[1] or "test_layer_replay.py" in s[1]]
    assert [o for o, _ in mine] == [op] * ex.forward.mqk.n_layers, sites
