"""``analyses.layer_graphs``: a batch's attention analyses recorded at one layer and replayed at the others
(a CUDA graph on a GPU; on a CPU a torch.fx trace, which runs the recorded operations and not the Python
that issued them, as a graph does) give every layer's statistics as computing each layer does."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
import torch

from actlake.analysis.engine.forward import layer_graphs_on
from actlake.analysis.engine.layer_replay import LayerReplay, _same_layout
from actlake.analysis.registry import enabled
from actlake.analysis.stats import SumStats, zeros
from actlake.batching import Window
from actlake.config import parse_config
from actlake.errors import AnalysisError, ConfigError
from actlake.jobs.extract.driver import Extractor
from actlake.model import load_model
from tests.conftest import FAMILIES, job_config

pytestmark = pytest.mark.integration


def _windows(lm, lengths=(13, 7, 10)):
    """Windows of different lengths (padding in the batch), with the tokenizer's special tokens."""
    from actlake.batching import special_affixes

    pre, post = special_affixes(lm.tokenizer)
    g = torch.Generator().manual_seed(1)
    return [Window(d, 0, pre + torch.randint(5, 300, (n,), generator=g).tolist() + post, "s")
            for d, n in enumerate(lengths)]


def _extractor(model_path, tmp_path, graphs: bool, device: str = "cpu", **analyses):
    overrides = {f"analyses.{k}": v for k, v in {"tokens": False, "layer_graphs": graphs, **analyses}.items()}
    if device == "cuda":  # bfloat16: the FlashAttention path and the Triton kernels, in a CUDA graph
        overrides.update({"model.device": "cuda", "model.dtype": "bfloat16"})
    cfg = job_config(model_path, tmp_path, tmp_path / "out", **overrides)
    forward = Extractor(cfg, load_model(cfg.model)).forward
    forward.checked = True  # a worker's later batches: the first is self-checked (tests/integration/test_families.py)
    return forward


def _fields(stats: dict) -> dict:
    return {(name, f): v for name, a in stats.items() for f, v in vars(a).items() if isinstance(v, torch.Tensor)}


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("family", [*FAMILIES, "minilm"])
@pytest.mark.parametrize("options", [{}, {"contributions": {"by_query_category": True}, "attention_weights": "explicit"}],
                         ids=["defaults", "by-query-category"])
def test_replayed_layers_equal_layers_computed_one_by_one(family, options, device, deep_tiny_models, request,
                                                          tmp_path):
    path = request.getfixturevalue("minilm_path") if family == "minilm" else deep_tiny_models[family]
    eager = _extractor(path, tmp_path, False, device, **options)
    graphs = _extractor(path, tmp_path, True, device, **options)
    windows = _windows(eager.lm)
    with torch.inference_mode():
        want = eager.run_batch(windows, strict=False)
        launched = graphs.launch(windows, strict=False)
    assert launched.passed()
    got, replay = launched.result, launched.recorder.replay
    # layer 0 as it is, layer 1 recorded, then replayed at layers 1 .. L-1
    assert replay.replays == eager.mqk.n_layers - 1 >= 3
    w, g = _fields(want.stats), _fields(got.stats)
    assert w.keys() == g.keys() and len(w) >= 15
    tol = 1e-12 if device == "cpu" else 1e-6  # the same kernels in a graph (cuBLAS may choose others)
    for k in w:
        scale = float(w[k].abs().max()) or 1.0
        torch.testing.assert_close(g[k], w[k], rtol=0, atol=tol * scale, msg=lambda m: f"{k}: {m}")
    # the attention output handed to the model came from the replays: the hidden states downstream agree
    torch.testing.assert_close(got.parts["residual_norms"].norms, want.parts["residual_norms"].norms, rtol=tol, atol=0)
    if want.surprisal is not None:
        torch.testing.assert_close(got.surprisal, want.surprisal, rtol=1e-6 if device == "cpu" else 1e-3, atol=0,
                                   equal_nan=True)


@dataclass
class LayerScaled(SumStats):
    """Sums q times (layer + 1): the Python number lq.layer is baked into a recording (0 there)."""

    name = "layer_scaled"
    sites = frozenset({"attention"})
    tables = ("layer_scaled",)
    graph_safe = True
    total: torch.Tensor

    @classmethod
    def create(cls, spec, **options):
        return cls(zeros(spec.n_layers, device=spec.device))

    def add_layer(self, lq) -> None:
        self.total[lq.layer] += lq.valid_query.sum().double() * (lq.layer + 1)

    def to_tables(self):
        return {}

    @classmethod
    def from_tables(cls, tables):
        raise NotImplementedError


class ReadsBack(LayerScaled):
    name = "reads_back"

    def add_layer(self, lq) -> None:
        self.total[lq.layer] += float(lq.query.sum())  # a host read: no graph can hold it


def _custom(cls):
    return {"custom": [{"analysis": f"{__name__}:{cls.__name__}"}], "dim_moments": False, "residual_norms": False}


def test_a_replay_runs_the_recorded_operations_not_the_python(deep_tiny_models, tmp_path):
    """Why an analysis must be graph_safe: what its Python computes (here from lq.layer) is fixed at the
    recorded layer. The CPU's trace shows that as a CUDA graph would: the replayed layers get the factor
    the recording saw. Each layer's own q sum is still its own (those are the recorded operations)."""
    path = deep_tiny_models["gpt_neox"]
    eager, graphs = (_extractor(path, tmp_path, g, **_custom(LayerScaled)) for g in (False, True))
    windows = _windows(eager.lm)
    with torch.inference_mode():
        want = eager.run_batch(windows, strict=False).stats["layer_scaled"].total
        got = graphs.run_batch(windows, strict=False).stats["layer_scaled"].total
    plain = want / torch.arange(1, len(want) + 1, dtype=torch.float64)  # each layer's sum of q
    torch.testing.assert_close(got[0], want[0])  # layer 0 runs as it is
    torch.testing.assert_close(got[1:], plain[1:], rtol=1e-12, atol=1e-12)  # recorded with lq.layer = 0: factor 1
    assert not torch.allclose(got[2:], want[2:])


def test_an_analysis_that_reads_back_cannot_be_recorded(deep_tiny_models, tmp_path):
    ex = _extractor(deep_tiny_models["llama"], tmp_path, True, **_custom(ReadsBack))
    with torch.inference_mode(), pytest.raises(AnalysisError, match=r"_local_scalar_dense.*layer_graphs: false"):
        ex.run_batch(_windows(ex.lm), strict=False)


class NotDeclared(LayerScaled):
    name, graph_safe = "not_declared", False


def test_layer_graphs_refuse_analyses_not_declared_graph_safe(deep_tiny_models, tmp_path):
    with pytest.raises(ConfigError, match=r"layer_graphs: true needs every attention analysis to be graph_safe; "
                                          r"\['not_declared'\]"):
        _extractor(deep_tiny_models["gpt2"], tmp_path, True, **_custom(NotDeclared))
    _extractor(deep_tiny_models["gpt2"], tmp_path, False, **_custom(NotDeclared))  # fine without layer graphs
    _extractor(deep_tiny_models["gpt2"], tmp_path, None, **_custom(NotDeclared))  # and by default (then off)


def test_layer_graphs_by_default_on_gpu_workers_when_every_attention_analysis_is_graph_safe(caplog):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert layer_graphs_on(None, cuda, []) and not layer_graphs_on(None, cpu, [])
    with caplog.at_level(logging.INFO, "actlake.extract"):
        assert not layer_graphs_on(None, cuda, ["not_declared"])
    assert "analyses.layer_graphs off: ['not_declared'] not declared graph_safe" in caplog.text
    assert not layer_graphs_on(False, cuda, []) and layer_graphs_on(True, cpu, [])
    # every built-in attention analysis is graph_safe, so a default job on a GPU replays its layers
    cfg = parse_config({"name": "defaults"})
    attention = [c for c, _ in enabled(cfg) if "attention" in c.sites]
    assert attention and all(c.graph_safe for c in attention)


def test_a_failed_recording_leaves_nothing_to_replay():
    replay = LayerReplay([ReadsBack(zeros(3))])
    inputs = {"query": torch.ones(2, 3), "key": None}
    with pytest.raises(AnalysisError, match=r"recording a layer's analyses failed .*layer_graphs: false"):
        replay.record(inputs, None, lambda static, consumers: float(static["query"].sum()) and None)
    assert replay.static is None and not replay.fits(inputs, None)


def test_the_recorded_buffers_keep_the_layout_of_the_layers_inputs():
    """q of a fused qkv projection is a strided slice: the recording's buffer has its strides (kernels
    specialised on layout see at the replayed layers what they saw at the first)."""
    qkv = torch.randn(2, 5, 3, 4, 8)  # (B, T, 3, H, d_h)
    q = qkv[:, :, 0].transpose(1, 2)  # (B, H, T, d_h), not contiguous, with gaps
    static = _same_layout(q)
    assert static.stride() == q.stride() != q.contiguous().stride()
    assert torch.equal(static, q) and static.data_ptr() != q.data_ptr()
    kv = torch.randn(2, 1, 5, 8).expand(2, 4, 5, 8)  # a key head shared by 4 query heads, expanded
    static = _same_layout(kv)
    assert static.is_contiguous() and torch.equal(static, kv)
    static.copy_(kv + 1)  # a replay's copy into the buffer
    assert torch.equal(static, kv + 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_successive_cuda_batches_record_their_own_graphs(deep_tiny_models, tmp_path):
    """Each batch records a graph after the previous batch's graph is gone (run_batch drops it): the
    allocator must accept the new recording (a pool shared by recordings would trip an assertion)."""
    eager = _extractor(deep_tiny_models["llama"], tmp_path, False, "cuda")
    graphs = _extractor(deep_tiny_models["llama"], tmp_path, True, "cuda")
    for lengths in ((13, 7, 10), (9, 12), (13, 7, 10)):
        windows = _windows(eager.lm, lengths)
        with torch.inference_mode():
            want, got = eager.run_batch(windows, strict=False), graphs.run_batch(windows, strict=False)
        w, g = _fields(want.stats), _fields(got.stats)
        for k in w:
            torch.testing.assert_close(g[k], w[k], rtol=0, atol=1e-6 * (float(w[k].abs().max()) or 1.0))
