"""Hidden states handed to the analyses one layer at a time (capture.HiddenStream) are Hugging Face's
``output_hidden_states``, and neither they nor the key projection's inputs outlive their layer."""

from __future__ import annotations

import pytest
import torch

from actlake.analysis.engine import capture
from actlake.config import ModelConfig
from actlake.model import load_model
from tests.conftest import FAMILIES

pytestmark = pytest.mark.integration


def _ids(lm, B=3, T=9):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, min(lm.model.config.vocab_size, 1000), (B, T), generator=g)
    valid = torch.ones(B, T, dtype=torch.long)
    valid[1, 5:] = 0
    return ids, valid


@pytest.mark.parametrize("family", [*FAMILIES, "minilm"])
def test_the_stream_hands_over_output_hidden_states_in_order(family, tiny_models, minilm_path):
    lm = load_model(ModelConfig(name_or_path=minilm_path if family == "minilm" else str(tiny_models[family])))
    ids, valid = _ids(lm)
    with torch.no_grad():
        want = lm.model(input_ids=ids, attention_mask=valid, output_hidden_states=True).hidden_states
        got = []
        stream = capture.HiddenStream(lm.model, lm.family)
        with stream(lambda layer, h: got.append((layer, h.clone()))):
            out = lm.model(input_ids=ids, attention_mask=valid)
            stream.last(out.last_hidden_state)
    assert [layer for layer, _ in got] == list(range(len(want)))
    for (_, h), w in zip(got, want):
        torch.testing.assert_close(h, w, rtol=0, atol=0)
    with torch.no_grad():  # hooks removed on exit: a later forward pass hands nothing over
        lm.model(input_ids=ids, attention_mask=valid)
    assert len(got) == len(want)


def test_no_hidden_state_or_key_input_outlives_its_layer(minilm_path, tmp_path):
    """all-MiniLM-L6-v2 (6 layers) through ForwardPass.run_batch with every analysis on (the contributions read the key projection's inputs,
    moments and norms every hidden state, activations stored for one layer): when block ℓ starts, the
    outputs of blocks before ℓ-1 and the key projection's inputs of layers before ℓ are freed, as in a
    plain forward pass (``output_hidden_states`` and the key inputs of every layer used to stay until
    the forward pass returned)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from actlake.architectures import blocks, key_input_module
    from actlake.batching import Window, collate
    from actlake.jobs.extract.driver import Extractor
    from tests.conftest import job_config

    cfg = job_config(minilm_path, tmp_path, tmp_path / "out", **{"activations.layers": [1]})
    lm = load_model(cfg.model, lm_head=None)
    ex = Extractor(cfg, lm)
    ex.forward.checked = True  # a later batch: the first one's self-check holds x for its own comparison
    outputs, key_inputs, alive = {}, {}, []  # weak references to storages; per block: how many old ones live

    def at_block(i):
        def hook(module, args):
            old = [ref for j, ref in outputs.items() if j < i - 1] + [ref for j, ref in key_inputs.items() if j < i]
            alive.append(sum(not ref.expired() for ref in old))
        return hook

    def keep_ref(refs, i, take):
        def hook(module, args, output=None):
            refs[i] = StorageWeakRef(take(args, output).untyped_storage())
        return hook

    def alive_per_block(run):
        outputs.clear(), key_inputs.clear(), alive.clear()
        handles = []
        try:
            for i, block in enumerate(blocks(lm.model, lm.family)):
                handles.append(block.register_forward_pre_hook(at_block(i)))
                handles.append(block.register_forward_hook(
                    keep_ref(outputs, i, lambda a, o: o[0] if isinstance(o, tuple) else o)))
                handles.append(key_input_module(block, lm.family).register_forward_pre_hook(
                    keep_ref(key_inputs, i, lambda a, o: a[0])))
            out = run()
        finally:
            for h in handles:
                h.remove()
        return list(alive), out

    g = torch.Generator().manual_seed(0)
    windows = [Window(d, 0, torch.randint(5, 1000, (n,), generator=g).tolist(), "s") for d, n in enumerate((12, 7))]
    ids, mask = collate(windows, lm.tokenizer.pad_token_id)
    with torch.inference_mode():
        plain, _ = alive_per_block(lambda: lm.model(input_ids=ids, attention_mask=mask))
    suite, result = alive_per_block(lambda: ex.forward.run_batch(windows))
    L = lm.model.config.num_hidden_layers
    assert len(suite) == L >= 3
    assert suite == plain, (suite, plain)  # BERT's forward keeps the embeddings (layer 0's key input) itself
    assert result.parts["residual_norms"].norms.shape[-1] == L + 1 and set(result.parts["activations"].acts) == {1}
    assert ex.forward.stream.consume is None  # the batch's consumer (its buffers) is not kept for the next batch
