"""The attention output handed back to the model from the analyses' own weights, and the check that
the model's attention mask is the one the statistics assume: tiny random models of every family."""

from __future__ import annotations

import pytest
import torch

from actlake.analysis.attention_mass import AttentionMass
from actlake.analysis.engine import capture
from actlake.analysis.engine.recorder import AttentionRecorder, ModelQK
from actlake.categories import ROLE, one_hot
from actlake.config import ModelConfig
from actlake.model import load_model
from tests.conftest import FAMILIES

pytestmark = pytest.mark.integration


def _batch(vocab, B=3, T=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, min(vocab, 1000), (B, T), generator=g)
    valid = torch.ones(B, T, dtype=torch.long)
    valid[1, 7:] = 0
    valid[2, 4:] = 0
    role = torch.randint(0, len(ROLE), (B, T), generator=g)
    return ids, valid, one_hot(role, len(ROLE), valid)


def _run(lm, ids, valid, onehot, needs, method="auto"):
    """The model's output, the recorder and the attention mass it fed (as a job feeds its analyses)."""
    mqk = ModelQK(lm.model, lm.family)
    mass = AttentionMass.zeros(mqk.n_layers, mqk.n_heads)
    rec = AttentionRecorder(mqk, valid, onehot, [mass.add_layer], needs=frozenset(needs) | mass.products,
                            method=method, on_excluded=[mass.nonfinite_excluded])
    with torch.no_grad(), capture.recording(rec):
        out = lm.model(input_ids=ids, attention_mask=valid, output_hidden_states=True)
    return out, rec, mass


@pytest.mark.parametrize("family", FAMILIES)
def test_the_model_computes_the_same_with_its_attention_output_taken_from_the_analyses(family, tiny_models):
    lm = load_model(ModelConfig(name_or_path=str(tiny_models[family])))
    ids, valid, onehot = _batch(lm.model.config.vocab_size)
    with torch.no_grad():
        plain = lm.model(input_ids=ids, attention_mask=valid, output_hidden_states=True)  # SDPA, nothing captured
    capture.install(lm.model)
    reused, rec, mass = _run(lm, ids, valid, onehot, {"mass", "distance", "weighted_qsum"})
    assert rec.replaced_layers == lm.model.config.num_hidden_layers  # no kernel call was needed
    kernel, rec2, mass2 = _run(lm, ids, valid, onehot, {"mass"}, method="fused")  # the kernel runs; mass from one-hot V
    assert rec2.replaced_layers == 0
    real = valid.bool()  # padded positions carry no meaning (and are not compared)
    for a, b, c in zip(plain.hidden_states, reused.hidden_states, kernel.hidden_states):
        torch.testing.assert_close(b[real], a[real], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c[real], a[real], rtol=0, atol=0)
    torch.testing.assert_close(mass.mass, mass2.mass, rtol=1e-5, atol=1e-6)


def test_eager_models_and_fused_statistics_keep_the_kernel(tiny_models):
    lm = load_model(ModelConfig(name_or_path=str(tiny_models["llama"]), attn_implementation="eager"))
    capture.install(lm.model)
    ids, valid, onehot = _batch(lm.model.config.vocab_size)
    _, rec, _ = _run(lm, ids, valid, onehot, {"mass", "distance"})
    assert rec.replaced_layers == 0  # eager callers may ask for the weights: the kernel always runs
    lm = load_model(ModelConfig(name_or_path=str(tiny_models["llama"])))
    capture.install(lm.model)
    _, rec, _ = _run(lm, ids, valid, onehot, {"mass", "mass_keynorm"}, method="fused")
    assert rec.replaced_layers == 0


def _mistral(tokenizer_dir, out, sliding_window):
    """A tiny random Mistral (the llama family with a sliding window), saved and loaded for real."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, MistralConfig

    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    cfg = MistralConfig(vocab_size=400, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                        sliding_window=sliding_window)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out


def test_a_sliding_window_shorter_than_the_batch_counts_the_pairs_it_attends(tiny_models, tmp_path):
    """Sliding-window attention (Mistral, window 4 on 11-token windows): the statistics count the pairs the model
    attends (its masses equal its own eager weights by category) and the output handed back from the analyses'
    weights is the kernel's (the model's hidden states unchanged)."""
    ids, valid, onehot = _batch(400)
    lm = load_model(ModelConfig(name_or_path=str(_mistral(tiny_models["llama"], tmp_path / "sw4", 4))))
    capture.install(lm.model)
    out, rec, mass = _run(lm, ids, valid, onehot, {"mass"})
    assert rec.replaced_layers == 2
    plain = load_model(ModelConfig(name_or_path=str(tmp_path / "sw4"), attn_implementation="eager"))
    with torch.no_grad():
        ref = plain.model(input_ids=ids, attention_mask=valid, output_hidden_states=True, output_attentions=True)
    v = valid.bool()
    for h, r in zip(out.hidden_states, ref.hidden_states):
        torch.testing.assert_close(h[v], r[v], rtol=1e-5, atol=1e-5)
    for layer, alpha in enumerate(ref.attentions):
        assert float(alpha[0, 0, 10, :6].abs().max()) == 0.0  # the window is really shorter than the batch
        want = torch.einsum("bhmn,bnc,bm->hc", alpha.double(), onehot.double(), valid.double())
        got = torch.as_tensor(mass.mass[layer]).sum(1).double()  # (H, Ck): summed over query categories
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
