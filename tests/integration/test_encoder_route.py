"""The encoder route (issue 35 §2): on a GPU worker with the Triton kernels, a bidirectional model's attention
statistics come from the kernels of ``padded_products`` (no T x T weights, no float32 copy of q and k). A
batch's every statistic through that route equals an explicit-weights run of the same batch. On a CPU the
kernels run in Triton's interpreter (conftest.py) and the route is taken as on a GPU: only its device test
(``padded_applies``: CUDA, compute capability, 16-bit) is widened to this CPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from actlake.analysis.engine import kernels, recorder  # noqa: E402
from actlake.analysis.engine.attention_weights import padded_applies  # noqa: E402
from tests.integration.test_layer_replay import CUDA, _extractor, _fields, _windows  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("model", ["bert", "minilm"])
def test_encoder_batches_through_the_kernels_equal_explicit_weights(model, device, tiny_models, request, tmp_path,
                                                                     monkeypatch):
    path = request.getfixturevalue("minilm_path") if model == "minilm" else tiny_models["bert"]
    explicit = _extractor(path, tmp_path, False, device, attention_weights="explicit")
    routed = _extractor(path, tmp_path, False, device)
    if device == "cpu":  # the GPU's route, its kernels interpreted
        routed.triton = True
        monkeypatch.setattr(recorder, "padded_applies",
                            lambda q, batch: q.device.type == "cpu" and not batch.causal and batch.lengths is not None)
    else:
        assert routed.triton and padded_applies(torch.zeros(1, 1, 1, 8, device="cuda", dtype=torch.bfloat16),
                                                type("B", (), {"causal": False, "lengths": [1]})())
    kernels._verified.discard(("bidirectional attention", torch.device(device, 0) if device == "cuda" else torch.device(device)))
    windows = _windows(explicit.lm, lengths=(13, 7, 1, 10))  # ragged, and a window of one token (plus specials)
    want, got = explicit.run_batch(windows), routed.run_batch(windows)
    assert any(route == "bidirectional attention" for route, _ in kernels._verified)  # the kernels ran
    tol = 1e-5 if device == "cpu" else 2e-2  # float32 in both on a CPU; bfloat16 on a GPU
    w, g = _fields(want.stats), _fields(got.stats)
    assert w.keys() == g.keys()
    for key, value in w.items():
        torch.testing.assert_close(g[key].double().cpu(), value.double().cpu(), rtol=tol,
                                   atol=tol * max(value.abs().max().item(), 1.0), msg=str(key))
