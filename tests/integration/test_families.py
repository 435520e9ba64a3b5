"""Every supported model family against float64 eager transformers; refusals before Ray; the first-batch
self-check catching planted declaration errors; a real job end to end on three families.

Tiny models (tests/zoo_models.py) have their scaling knobs away from the defaults (softcaps, logit scales,
multipliers, partial rotary) and q/k weights large enough that attention is far from uniform."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig

from actlake import architectures
from actlake.architectures import Family, check_config, family_for
from actlake.errors import ConfigError, ModelLoadError
from tests.conftest import job_config
from tests.zoo_check import QUANTITIES, batch, compare, engine
from tests.zoo_models import CAUSAL, ENCODERS, REFUSED, build, tiny_config

pytestmark = pytest.mark.integration

EXACT = 1e-5
"""Largest error relative to the largest reference value (float32 engine vs float64 reference: about 1e-7)."""


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("zoo")
    made: dict = {}

    def get(model_type: str, **overrides):
        key = (model_type, repr(sorted(overrides.items())))
        if key not in made:
            made[key] = str(build(model_type, root / f"{model_type}-{len(made)}", **overrides))
        return made[key]
    return get


@pytest.mark.parametrize("model_type", CAUSAL + ENCODERS)
def test_every_default_analysis_equals_float64_transformers(model_type, zoo):
    err = compare(zoo(model_type))
    assert err.pop("self_check") == []
    assert set(err) == set(QUANTITIES) - ({"surprisal"} if model_type in ENCODERS else set())
    assert max(err.values()) < EXACT, err


@pytest.mark.parametrize("model_type", REFUSED)
def test_refused_families_say_why_in_one_line(model_type):
    with pytest.raises(ModelLoadError) as e:
        check_config(AutoConfig.for_model(model_type))
    msg = str(e.value)
    assert f"model_type {model_type!r} is not supported: " in msg and "\n" not in msg


def test_an_unknown_model_type_names_itself_and_the_supported_ones():
    with pytest.raises(ModelLoadError, match=r"model_type 'mamba' is not supported: .*supported: .*qwen3"):
        family_for("mamba")


def test_windows_longer_than_a_llama4_chunk_are_refused_before_ray(zoo, tmp_path, sample_corpus):
    """Llama 4's chunked attention is not modelled: windows that fit in a chunk run (exact, above), longer ones
    are refused by name, from the local folder's config.json (precheck) and from its transformers config."""
    from actlake.architectures import check_model, precheck

    folder = zoo("llama4_text", attention_chunk_size=16, layer_types=["chunked_attention", "full_attention"])
    for check in (precheck, check_model):
        check(job_config(folder, sample_corpus, tmp_path / "out", **{"tokenization.max_length": 16}))
        with pytest.raises(ModelLoadError, match=r"'llama4_text' with attention_chunk_size 16 and tokenization.max_"
                                                 r"length 32: chunked attention .* set tokenization.max_length to 16"):
            check(job_config(folder, sample_corpus, tmp_path / "out", **{"tokenization.max_length": 32}))


def test_a_llama4_multimodal_config_refuses_windows_longer_than_its_text_models_chunk():
    from actlake.architectures import check_chunks

    config = tiny_config("llama4")
    config.text_config.attention_chunk_size = 16
    check_chunks(config, 16)
    with pytest.raises(ModelLoadError, match=r"'llama4' with attention_chunk_size 16 and tokenization.max_length 24"):
        check_chunks(config, 24)


def test_a_checkpoint_that_would_leave_block_weights_random_is_refused_at_load(zoo, monkeypatch):
    """Emu3's multimodal checkpoint, loaded as its causal LM (the class transformers picks for the type), matches none
    of its keys: every block weight would be random. Loaded as its multimodal model instead (exact: above); without
    that class to fall back on, refused in one line, naming the class and a weight."""
    from actlake import model as model_module
    from actlake.config import ModelConfig
    from actlake.model import load_model

    folder = zoo("emu3")
    assert type(load_model(ModelConfig(name_or_path=folder), lm_head=None).causal_lm).__name__ == (
        "Emu3ForConditionalGeneration")
    monkeypatch.setattr(model_module, "_multimodal_instead", lambda *args: False)
    with pytest.raises(ModelLoadError, match=r"weights of its transformer blocks are not in the checkpoint under the "
                                             r"names Emu3ForCausalLM reads \(e.g. model.layers.0.") as e:
        load_model(ModelConfig(name_or_path=folder), lm_head=None)
    assert "\n" not in str(e.value)


def test_a_config_feature_that_is_not_modelled_is_refused_by_name():
    with pytest.raises(ModelLoadError, match=r"'stablelm' with qk_layernorm: True is not supported: per-head q/k "
                                             r"LayerNorm"):
        check_config(tiny_config("stablelm", qk_layernorm=True))


@pytest.mark.parametrize("model_type, overrides", [("cohere", {"use_qk_norm": True}), ("phi", {"qk_layernorm": True})])
def test_a_key_layernorm_is_exact(model_type, overrides, zoo):
    """Cohere's q/k LayerNorm (per head, gains per head randomised, no bias): its mean subtraction is folded into
    W_K, r_n is the centred input's RMS. Phi's (one gain for every head, and a bias, randomised, then partial RoPE):
    the bias joins the bias term."""
    err = compare(zoo(model_type, **overrides))
    assert err.pop("self_check") == []
    assert max(err.values()) < EXACT, err


@pytest.mark.parametrize("model_type, overrides, why", [
    ("gemma3n_text", {}, r"altup_num_inputs 4 gives each token 4 residual streams"),
    ("hy_v4", {}, r"hc_mult 4 gives each token 4 residual streams"),
    ("laguna", {"num_attention_heads_per_layer": [4, 8]},
     r"different numbers of query heads \(num_attention_heads 4, num_attention_heads_per_layer 8\)"),
    ("olmoe", {"clip_qkv": 8.0}, r"clipped keys with a key norm"),  # clipped keys on a plain key path: exact
    ("inkling_text", {}, r"a convolution over positions \(k_sconv\)"),
    ("mobilebert", {"normalization_type": "layer_norm"},
     r"a LayerNorm in the key bottleneck \(not affine\)"),  # 'mobilebert' with normalization_type: 'layer_norm'
    ("inkling2_text", {}, r"its key projection \(Inkling2KeyValueProjection\) has no single weight matrix"),
    ("gemma4_unified_assistant", {}, r"a drafter \(assistant\) model"),
    ("albert", {"inner_group_num": 2}, r"several blocks per group call"),  # call-order layers: one block per call
    ("albert", {"inner_group_num": 2, "num_hidden_groups": 2, "num_hidden_layers": 2}, r"several blocks per group"),
    ("blt", {}, r"its transformer blocks are in 6 stacks \(local_encoder.layers"),
    ("zamba2", {}, r"its key projection reads a 128-wide input, not the 64-wide residual stream"),
    # attention by hand, found from the model's modules (no list of blocks to look in) or its attention's forward
    ("xlm", {}, "attention computed outside the transformers attention interface"),
    ("squeezebert", {}, "attention computed outside the transformers attention interface"),
    ("git", {}, "attention computed outside the transformers attention interface"),  # only its vision tower uses it
    ("fnet", {}, "no attention module was found in the model"),
    ("xlstm", {}, "no attention module was found in the model"),
    ("musicgen", {}, r"num_codebooks 4 parallel audio codebook tokens per position"),  # an encoder-decoder model's
    ("prophetnet", {}, "attention computed outside the transformers attention interface"),  # decoder: not exact
])
def test_a_feature_that_is_not_modelled_is_refused_from_the_config(model_type, overrides, why):
    """Refused before Ray, in one line naming the feature (from the config, and a weightless model for undeclared
    types)."""
    with pytest.raises(ModelLoadError, match=rf"model_type '{model_type}'.* is not supported: .*{why}") as e:
        check_config(tiny_config(model_type, **overrides))
    assert "\n" not in str(e.value)


def test_sparse_attention_longer_than_its_indexer_keeps_is_refused():
    """DeepSeek V3.2's indexer keeps index_topk keys per query: windows that fit run (exact in the zoo), longer ones
    are refused by name."""
    from actlake.architectures import check_chunks

    config = tiny_config("deepseek_v32", index_topk=16)
    check_chunks(config, 16)
    with pytest.raises(ModelLoadError, match=r"'deepseek_v32' with index_topk 16 and tokenization.max_length 24: sparse "
                                             r"attention .* set tokenization.max_length to 16 or less"):
        check_chunks(config, 24)


def test_discovery_reads_how_the_head_applies_a_logit_scale():
    """Granite divides its logits by logits_scaling, HyperCLOVA X multiplies them: read off the head's source."""
    from actlake.discovery import discover

    assert discover(tiny_config("hyperclovax")).logits == ("multiply:logits_scaling",)
    assert discover(tiny_config("granitemoe")).logits == ("divide:logits_scaling",)


@pytest.mark.parametrize("model_type, overrides", [
    ("mistral", {"sliding_window": 5}),  # every layer windowed
    ("gemma2", {"sliding_window": 5}),  # local and global layers alternating, softcapped
    ("gemma3_text", {"sliding_window": 6}),
    ("modernbert", {"local_attention": 8}),  # bidirectional: |m - n| <= 4
])
def test_sliding_windows_count_the_pairs_each_layer_attends(model_type, overrides, zoo):
    """Windows far shorter than the 24-token batch: every statistic over the pairs each layer attends (the
    distance profile limited to the window), equal to float64 transformers."""
    err = compare(zoo(model_type, **overrides))
    assert err.pop("self_check") == []
    assert max(err.values()) < EXACT, err


def _declared(monkeypatch, model_type: str, **changes) -> None:
    """Run ``model_type`` under a wrong declaration (its family with ``changes``), first in the lookup."""
    fam = dataclasses.replace(family_for(model_type), model_types=(model_type,), **changes)
    monkeypatch.setattr(architectures, "FAMILIES", (fam,) + architectures.FAMILIES)


@pytest.mark.parametrize("model_type, changes, what, affected", [
    ("cohere", {"rope": "half"}, "the key path", "contributions"),  # interleaved RoPE declared as rotate-half
    ("qwen3", {"key_norm": None}, "the key path", "contributions"),  # the k norm left out
    ("gpt_neox", {"qkv": "stacked"}, "the key path", "contributions"),  # a fused projection's layout wrong
    ("gemma2", {"logits": ()}, "surprisal", "surprisal"),  # the final logit softcap left out
    ("cohere2", {"rope_layers": None}, "the key path", "contributions"),  # RoPE assumed on its NoPE global layers
])
def test_the_self_check_catches_a_wrong_declaration(model_type, changes, what, affected, zoo, monkeypatch):
    folder = zoo(model_type)
    _declared(monkeypatch, model_type, **changes)
    ids, valid, role = batch(512)
    check = engine(folder, ids, valid, role)[5]
    assert check.failures and all(what in f and affected in f for f in check.failures), check.failures
    with pytest.raises(Exception, match="self-check of the first batch failed"):
        check.raise_if_failed(model_type)


@pytest.mark.parametrize("plant", ["norm on every dim", "rotary pairs not reordered"])
def test_the_self_check_catches_a_wrong_latent_key_path(plant, zoo, monkeypatch):
    """DeepSeek V3's keys through its latent: the latent norm's 1 / r_n put on the rotary dims too, or the
    interleaved rotary dims taken in the order the down-projection gives them. Either is caught at the key path."""
    import copy

    from actlake.analysis.engine import recorder

    if plant == "norm on every dim":
        monkeypatch.setattr(recorder, "latent_scaled_dims", lambda family, config, head_dim: torch.ones(head_dim))
    else:
        real = architectures.latent_key_weights

        def unordered(block, family, config, *args):
            config = copy.copy(config)
            config.rope_interleave = False
            return real(block, family, config, *args)
        monkeypatch.setattr(architectures, "latent_key_weights", unordered)
    ids, valid, role = batch(512)
    check = engine(zoo("deepseek_v3"), ids, valid, role)[5]
    assert check.failures and all("the key path" in f and "contributions" in f for f in check.failures), check.failures


def test_a_fused_layout_that_does_not_fit_the_kernels_k_is_refused_by_name(zoo, monkeypatch):
    _declared(monkeypatch, "phi3", qkv="per_head")
    ids, valid, role = batch(512)
    with pytest.raises(ModelLoadError, match=r"self_attn.qkv_proj gives 128 key rows, the kernel's k has 32 .*"
                                             r"qkv layout 'per_head' is wrong"):
        engine(zoo("phi3"), ids, valid, role)


def test_the_self_check_catches_sinks_the_engine_does_not_see(zoo, monkeypatch):
    """gpt-oss with its learned sinks hidden from the engine (as a kernel argument of another name would be): the
    engine's weights times V differ from the model's attention output, and every attention analysis is named."""
    from actlake.analysis.engine import capture

    monkeypatch.setattr(capture, "sink_logits", lambda kwargs: None)
    ids, valid, role = batch(512)
    check = engine(zoo("gpt_oss"), ids, valid, role)[5]
    assert check.failures and all("the attention weights" in f and "attention_geometry" in f for f in check.failures)


def test_the_self_check_catches_attention_outside_the_interface(tmp_path, monkeypatch):
    """Falcon declared as if its attention went through the interface: no layer is ever recorded."""
    folder = str(build("falcon", tmp_path / "falcon"))
    monkeypatch.setattr(architectures, "FAMILIES", (Family(
        "falcon", ("falcon",), "h", "self_attention", "self_attention.query_key_value", qkv="stacked"),)
        + architectures.FAMILIES)
    ids, valid, role = batch(512)
    check = engine(folder, ids, valid, role)[5]
    assert any("never called the transformers attention interface" in f and "contributions" in f
               for f in check.failures), check.failures


def test_a_planted_error_stops_the_job_before_anything_is_written(zoo, sample_corpus, tmp_path, ray_local):
    """A real job whose engine reads Cohere's interleaved RoPE as rotate-half (planted in the workers by a custom
    analysis module that patches the engine when imported): the first batch fails, by name, and nothing is
    committed."""
    from actlake.jobs.extract.run import run_job
    from tests.integration.test_custom_analysis import LAST_NORM

    plant = tmp_path / "plant" / "plant_rope.py"
    plant.parent.mkdir()
    plant.write_text("from actlake.analysis.engine import rope\n_orig = rope.from_model\n"
                     "rope.from_model = lambda kind, pe: _orig('half' if kind == 'interleaved' else kind, pe)\n"
                     + LAST_NORM)
    cfg = job_config(zoo("cohere"), sample_corpus, tmp_path / "out", **{
        "analyses.custom": [{"analysis": "plant_rope:LastNorm", "path": str(plant)}], "corpus.max_docs": 8})
    with pytest.raises(Exception, match=r"(?s)self-check of the first batch failed for model_type 'cohere'.*"
                                        r"the key path.*affected: contributions"):
        run_job(cfg)
    assert not list((tmp_path / "out").rglob("*.parquet"))


def test_an_unsupported_model_is_refused_before_ray_in_one_line(tmp_path, sample_corpus):
    folder = tmp_path / "falcon"
    tiny_config("falcon").save_pretrained(folder)  # a config alone: nothing else is read
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"model: {{name_or_path: {folder}}}\ncorpus: {{paths: ['{sample_corpus}/*.jsonl.zst']}}\n"
                   f"output: {{dir: {tmp_path / 'out'}}}\n")
    env = dict(os.environ, RAY_ADDRESS="")
    r = subprocess.run([os.path.join(os.path.dirname(sys.executable), "actlake"), "run", str(cfg)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == [f"actlake: error: model_type 'falcon' is not supported: {architectures.NO_INTERFACE}"], r.stderr
    assert "ray" not in r.stdout.lower()
    loaded = subprocess.run([sys.executable, "-c", "import sys\nfrom actlake.jobs.cli import main\n"
                             f"rc = main(['run', {str(cfg)!r}])\n"
                             "print(rc, sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'ray')))"],
                            capture_output=True, text=True, env=env, timeout=300)
    assert loaded.stdout.split() == ["2", "[]"], loaded.stdout + loaded.stderr  # refused before any of them loads


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen3", "gptj", "modernbert"])  # q/k norm, interleaved RoPE, an encoder
def test_a_real_job_on_the_family_equals_transformers(model_type, zoo, sample_corpus, tmp_path, ray_local):
    from actlake.jobs.extract.run import run_job
    from actlake.storage.sql import open_run
    from tests.integration.test_pipeline import _check_against_reference

    folder = zoo(model_type)
    result = run_job(job_config(folder, sample_corpus, tmp_path / "out", **{"corpus.max_docs": 16}))
    _check_against_reference(result.run_dir, folder)
    if model_type in CAUSAL:  # surprisal against the model's own logits, window by window
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
        con = open_run(result.run_dir)
        rows = con.sql("SELECT doc_id, window_index, position, token_id, surprisal FROM tokens "
                       "ORDER BY doc_id, window_index, position").fetchall()
        windows: dict = {}
        for doc, win, pos, tid, s in rows:
            windows.setdefault((doc, win), []).append((tid, s))
        worst = 0.0
        with torch.no_grad():
            for toks in windows.values():
                ids = torch.tensor([[t for t, _ in toks]])
                lp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
                for pos in range(1, len(toks)):
                    worst = max(worst, abs(toks[pos][1] + float(lp[pos - 1, toks[pos][0]])))
        assert worst < 1e-3


def test_a_hybrid_job_has_attention_rows_for_its_attention_layers_only(zoo, sample_corpus, tmp_path, ray_local):
    """OLMo Hybrid's tiny model: layer 0 linear attention, layer 1 full attention. Hidden-state tables have every
    layer; the attention tables layer 1 only; the summary names the attention layers."""
    import json
    from pathlib import Path

    from actlake.jobs.extract.run import run_job
    from actlake.storage.sql import open_run

    result = run_job(job_config(zoo("olmo_hybrid"), sample_corpus, tmp_path / "out", **{"corpus.max_docs": 6}))
    con = open_run(result.run_dir)
    for table in ("attention_mass", "attention_geometry", "contributions"):
        assert con.sql(f"SELECT DISTINCT layer FROM {table} ORDER BY layer").fetchall() == [(1,)], table
    assert con.sql("SELECT min(n_queries) FROM attention_mass_by_key").fetchall()[0][0] > 0
    assert con.sql("SELECT count(DISTINCT layer) FROM residual_norms").fetchall()[0][0] == 3  # embeddings, 2 blocks
    assert json.loads((Path(result.run_dir) / "summary.json").read_text())["attention_layers"] == [1]


@pytest.mark.parametrize("model_type", ["qwen3", "modernbert"])
def test_a_worker_checks_its_first_batch_and_only_it(model_type, zoo, tmp_path):
    """The Extractor as a worker runs it: the first batch passes the check (hidden states from the block hooks
    equal output_hidden_states, surprisal equals the model's logits), later batches are not checked."""
    from actlake.jobs.extract.driver import Extractor
    from actlake.model import load_model
    from tests.integration.test_layer_replay import _windows

    cfg = job_config(zoo(model_type), tmp_path, tmp_path / "out")
    ex = Extractor(cfg, load_model(cfg.model, lm_head=cfg.analyses.surprisal))
    ex.forward.run_batch(_windows(ex.lm))
    assert ex.forward.checked
    ex.forward.run_batch(_windows(ex.lm))


def test_hooks_that_misread_a_hidden_state_are_caught(zoo, tmp_path, monkeypatch):
    """Block hooks handing the analyses something else than the model's hidden state (planted: block outputs
    scaled by 1.01) stop the first batch, naming the hidden state and the analyses that read them."""
    from actlake.analysis.engine import capture as cap
    from actlake.errors import AnalysisError
    from actlake.jobs.extract.driver import Extractor
    from actlake.model import load_model
    from tests.integration.test_layer_replay import _windows

    def misread(self, i):
        def hook(module, args, output):
            self.consume(i + 1, (output[0] if isinstance(output, tuple) else output).detach() * 1.01)
        return hook
    monkeypatch.setattr(cap.HiddenStream, "_output_of", misread)
    cfg = job_config(zoo("llama"), tmp_path, tmp_path / "out")
    ex = Extractor(cfg, load_model(cfg.model, lm_head=cfg.analyses.surprisal))
    with pytest.raises(AnalysisError, match=r"hidden state 1: the block hooks' differs .*affected: .*residual_norms"):
        ex.forward.run_batch(_windows(ex.lm))
    assert not ex.forward.checked


@pytest.mark.parametrize("model_type", ["internlm3", "granitemoe", "camembert", "glm",  # glm: GLM's RoPE layout
                                        "granite_swa",  # learned sinks, applied by scaling the kernel's output
                                        "minicpm3",  # multi-head latent attention, rotate-half
                                        "qwen3_next",  # a hybrid: layer 0 gated delta rule, layer 1 attention
                                        "afmoe",  # RoPE on the sliding-window layers only
                                        "nanochat", "lfm2",  # rotate_half negated; a key norm named k_layernorm
                                        "minimax",  # a hybrid whose lightning-attention blocks also hold self_attn
                                        "esmc",  # a key LayerNorm over all heads (centring folded into W_K)
                                        "deepseek_v32",  # latent attention, interleaved RoPE with no config flag
                                        "hyperclovax",  # logits multiplied by logits_scaling (Granite divides)
                                        "granitemoehybrid",  # Mamba blocks hold self_attn = None
                                        "doge",  # causal by its heads (a causal LM only), checked by the mask
                                        "gemma3",  # a multimodal wrapper: its text model's config and layers
                                        "qwen3_5",  # a multimodal checkpoint loaded as its causal LM (the text model)
                                        "emu3",  # a multimodal checkpoint its causal LM cannot read: loaded whole
                                        "hunyuan_v1_dense", "hunyuan_v1_moe",  # key norm after RoPE, with a gain
                                        "jetmoe",  # keys from a [k | v] projection, tiled per routed query slot
                                        "moshi",  # a wrapped key linear layer; RoPE computed inside the attention
                                        "ctrl",  # attention at multi_head_attention, keys from Wk
                                        "persimmon", "fuyu",  # per-head fused qkv, key LayerNorm with a bias
                                        "recurrent_gemma",  # temporal_block: recurrent or attention; logits_soft_cap
                                        "modernbert-decoder"])  # a prediction head before the output embedding
def test_an_undeclared_family_is_discovered_and_exact(model_type, zoo):
    from actlake.architectures import declared
    from actlake.discovery import discover

    assert declared(model_type) is None
    assert discover(tiny_config(model_type)).name == f"discovered:{model_type}"
    if model_type == "qwen3_next":
        from actlake.analysis.engine.recorder import ModelQK
        from actlake.config import ModelConfig
        from actlake.model import load_model

        lm = load_model(ModelConfig(name_or_path=zoo(model_type)), lm_head=None)
        assert ModelQK(lm.model, lm.family).attention_layers == [1]
    err = compare(zoo(model_type))
    assert err.pop("self_check") == []
    assert max(err.values()) < EXACT, err


@pytest.mark.parametrize("model_type", ["bart", "whisper", "bigbird_pegasus"])  # bigbird: eager, is_causal False
def test_an_encoder_decoder_models_decoder_runs_alone_and_exact(model_type, zoo, tmp_path, sample_corpus, caplog):
    """The type's causal LM (BartForCausalLM): the decoder without an encoder input, its cross-attention never called
    (not recorded, not expected by the layer check); its own heads (decoder_attention_heads 2, the encoder's 4), read
    as such; announced before Ray. Loaded without the head (no surprisal) it is still the decoder, not the seq2seq
    model."""
    from actlake.architectures import DECODER_ALONE, check_model
    from actlake.config import ModelConfig
    from actlake.discovery import discover
    from actlake.model import load_model

    folder = zoo(model_type, decoder_attention_heads=2)
    assert discover(tiny_config(model_type)).decoder_alone
    err = compare(folder)
    assert err.pop("self_check") == []
    assert set(err) == set(QUANTITIES) and max(err.values()) < EXACT, err
    with caplog.at_level("WARNING", logger="actlake.run"):
        check_model(job_config(folder, sample_corpus, tmp_path / "out"))
    assert sum(DECODER_ALONE in r.getMessage() for r in caplog.records) == 1
    lm = load_model(ModelConfig(name_or_path=folder), lm_head=False)
    assert lm.lm_head is None and type(lm.model).__name__.endswith("DecoderWrapper")


@pytest.mark.parametrize("model_type", ["bart", "marian", "whisper", "bigbird_pegasus"])
def test_a_seq2seq_checkpoint_loads_its_decoder_or_is_refused_by_name(model_type, tmp_path):
    """A real checkpoint of the seq2seq class (BartForConditionalGeneration's layout: the decoder's embeddings saved as
    model.shared.weight) loads the decoder with every weight the seq2seq model has: hidden states and logits equal its
    own decoder's and head's. BigBird-Pegasus's causal LM does not tie its head to those embeddings: refused by name."""
    from transformers import AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq

    from actlake.config import ModelConfig
    from actlake.model import load_model
    from tests.conftest import _bpe_tokenizer

    torch.manual_seed(0)
    s2s = (AutoModelForSpeechSeq2Seq if model_type == "whisper" else AutoModelForSeq2SeqLM).from_config(
        tiny_config(model_type)).eval()
    s2s.save_pretrained(tmp_path)
    _bpe_tokenizer(tmp_path, bos_prefix=True)
    if model_type == "bigbird_pegasus":
        with pytest.raises(ModelLoadError, match=r"its embeddings or output head \(lm_head.weight\) are not in the "
                                                 r"checkpoint under the names BigBirdPegasusForCausalLM reads") as e:
            load_model(ModelConfig(name_or_path=str(tmp_path)), lm_head=True)
        assert "\n" not in str(e.value)
        lm = load_model(ModelConfig(name_or_path=str(tmp_path), dtype="float32"), lm_head=False)  # the head unread
        ids = torch.randint(2, 500, (2, 12))
        with torch.no_grad():
            assert torch.equal(lm.model(input_ids=ids).last_hidden_state, s2s.model.decoder(input_ids=ids).last_hidden_state)
        return
    lm = load_model(ModelConfig(name_or_path=str(tmp_path), dtype="float32"), lm_head=True)
    ids = torch.randint(2, 500, (2, 12))
    with torch.no_grad():
        want = s2s.model.decoder(input_ids=ids).last_hidden_state
        assert torch.equal(lm.model(input_ids=ids).last_hidden_state, want)
        assert torch.equal(lm.causal_lm(input_ids=ids).logits, s2s.get_output_embeddings()(want))


@pytest.mark.parametrize("model_type, overrides, layers", [
    ("gpt2", {}, 2),
    ("bart", {"encoder_layers": 3, "decoder_layers": 2}, 2),  # num_hidden_layers reads the encoder's 3
    ("albert", {"num_hidden_layers": 4, "num_hidden_groups": 2}, 4),  # call-order layers: 4 calls of 2 blocks
    ("dory", {}, 3),  # its config counts 2 blocks
])
def test_the_driver_counts_the_layers_the_engine_counts(model_type, overrides, layers, zoo, tmp_path):
    """What the driver checks before Ray (interventions' hidden states, activation layers counted from the end, the
    store's announcement) counts the layers the engine records on the loaded model (architectures.layers_of); an
    intervention at a hidden state beyond the decoder's blocks is one line, not a worker's failure."""
    from transformers import AutoConfig

    from actlake.analysis.engine.recorder import ModelQK
    from actlake.architectures import layers_of
    from actlake.config import ModelConfig
    from actlake.model import load_model

    folder = zoo(model_type, **overrides)
    lm = load_model(ModelConfig(name_or_path=folder), lm_head=None)
    assert layers_of(AutoConfig.from_pretrained(folder)) == ModelQK(lm.model, lm.family).n_layers == layers
    if model_type == "bart":
        from actlake.jobs.extract.interventions import resolve_interventions
        from tests.conftest import job_config

        cfg = job_config(folder, tmp_path, tmp_path / "out",
                         interventions=[{"name": "z", "at": 2, "op": "zero", "dims": [0]}])
        with pytest.raises(ConfigError, match=r"interventions\[0\] \(z\)\.at: hidden state 2 .* 2 blocks"):
            resolve_interventions(cfg, AutoConfig.from_pretrained(folder))


@pytest.mark.parametrize("model_type, overrides, calls", [
    ("albert", {}, 2),  # one group's block for both layers
    ("albert", {"num_hidden_layers": 4, "num_hidden_groups": 2}, 4),  # groups 0, 0, 1, 1
    ("dory", {}, 3),  # its input block, then its recurrent block twice
    ("hrm_text", {}, 4),  # per high cycle: the low stack's block, then the high stack's; two stacks of one block
])
def test_call_order_layers_are_exact(model_type, overrides, calls, zoo, tmp_path, sample_corpus):
    """Blocks that run several times per forward pass: layer k is the k-th attention call (its block's weights, the
    inputs of that call), hidden state k + 1 the k-th block call's output, as the model's own output_hidden_states
    and attentions have them; the config declares how many calls a pass makes. Interventions are refused by name."""
    from actlake.analysis.engine.recorder import ModelQK
    from actlake.architectures import attention_calls, check_model
    from actlake.config import ModelConfig
    from actlake.model import load_model

    folder = zoo(model_type, **overrides)
    lm = load_model(ModelConfig(name_or_path=folder), lm_head=None)
    mqk = ModelQK(lm.model, lm.family)
    assert attention_calls(lm.model.config) == mqk.n_layers == calls and mqk.attention_layers == list(range(calls))
    assert len(mqk.layer_of) < calls
    err = compare(folder)
    assert err.pop("self_check") == []
    assert max(err.values()) < EXACT, err
    cfg = job_config(folder, sample_corpus, tmp_path / "out", **{"interventions": [
        {"name": "z", "at": 1, "op": "zero", "dims": [0]}]})
    with pytest.raises(ModelLoadError, match=rf"'{model_type}' with interventions is not supported: its blocks run "
                                             rf"several times per forward pass \({calls} attention calls\)"):
        check_model(cfg)


@pytest.mark.parametrize("declared", [-1, 1])
def test_a_wrong_number_of_calls_is_caught(declared, zoo, monkeypatch):
    """Dory declared with one call fewer than it makes (its last call would be misnumbered): the batch stops at the
    extra call, by name; with one more: the self-check finds the last layer never recorded and the hidden states
    misnumbered."""
    from actlake import architectures as arch
    from actlake.analysis.engine import capture, recorder
    from actlake.errors import AnalysisError

    folder = zoo("dory")
    wrong = lambda config: arch.attention_calls(config) + declared
    monkeypatch.setattr(recorder, "attention_calls", wrong)
    monkeypatch.setattr(capture, "attention_calls", wrong)
    ids, valid, role = batch(512)
    if declared < 0:
        with pytest.raises(AnalysisError, match=r"model_type 'dory': its attention modules were called more than the 2 "
                                                r"times per forward pass its config declares"):
            engine(folder, ids, valid, role)
        return
    check = engine(folder, ids, valid, role)[5]
    assert any("attention layers [3] of 4 never called" in f and "contributions" in f for f in check.failures)
    assert any("hidden state" in f and "residual_norms" in f for f in check.failures), check.failures


def test_a_second_kernel_call_with_the_same_q_and_k_is_one_layer(zoo, monkeypatch):
    """DiffLlama's attention calls the kernel twice per layer with the very q and k (only v differs: the same
    weights), so each layer is recorded once, exactly, and the self-check compares both outputs. A second call with
    another k (planted) stops the batch by name."""
    from transformers.models.diffllama import modeling_diffllama

    from actlake.errors import AnalysisError

    folder = zoo("diffllama")
    err = compare(folder)
    assert err.pop("self_check") == []
    assert max(err.values()) < EXACT, err
    interface = modeling_diffllama.ALL_ATTENTION_FUNCTIONS
    real = interface.get_interface

    def other_k(impl, default):
        kernel, n = real(impl, default), [0]

        def call(module, q, k, *args, **kwargs):
            n[0] += 1
            return kernel(module, q, k * 1.5 if n[0] % 2 == 0 else k, *args, **kwargs)
        return call
    monkeypatch.setattr(interface, "get_interface", other_k)
    ids, valid, role = batch(512)
    with pytest.raises(AnalysisError, match=r"model_type 'diffllama': attention layer 0 called the attention kernel "
                                            r"again in one forward pass with other q or k"):
        engine(folder, ids, valid, role)


@pytest.mark.parametrize("model_type", ["olmo", "dbrx"])
def test_clipped_keys_are_exact(model_type, zoo, monkeypatch):
    """clip_qkv 1.0 (about 40 % of the key entries clamped): k = clamp(x W_K + b_K) = x W_K + b_K + delta_n, the
    clip's correction delta_n in the bias term, so the sum rule holds exactly. Left out (planted), the self-check stops
    the contributions at the key path."""
    import json

    from actlake.analysis.engine.recorder import ModelQK

    folder = zoo(model_type, **({"clip_qkv": 1.0} if model_type == "olmo" else {}))
    if model_type == "dbrx":  # its clip is in attn_config
        path = os.path.join(folder, "config.json")
        config = json.loads(open(path).read())
        config["attn_config"]["clip_qkv"] = 1.0
        open(path, "w").write(json.dumps(config))
    err = compare(folder)
    assert err.pop("self_check") == []
    assert max(err.values()) < EXACT, err
    monkeypatch.setattr(ModelQK, "clip_shift", lambda self, x, w, b: None)
    ids, valid, role = batch(512)
    check = engine(folder, ids, valid, role)[5]
    assert check.failures and all("the key path" in f and "contributions" in f for f in check.failures), check.failures


def test_a_discovered_layout_that_is_wrong_is_caught(zoo, monkeypatch):
    """HunYuan's key norm comes after RoPE (its gain multiplies the rotated k); read as if it came before (the gain
    folded into W_K, as for Qwen 3), the self-check stops it at the key path."""
    from actlake import discovery

    folder = zoo("hunyuan_v1_dense")
    assert discovery.discover(tiny_config("hunyuan_v1_dense")).key_norm_after_rope
    monkeypatch.setattr(discovery, "_found", {})
    monkeypatch.setattr(discovery, "_norm_after_rope", lambda attention_class, norm: False)
    ids, valid, role = batch(512)
    check = engine(folder, ids, valid, role)[5]
    assert check.failures and all("the key path" in f and "contributions" in f for f in check.failures), check.failures


def test_the_self_check_catches_a_key_layernorm_bias_left_out(zoo, monkeypatch):
    """Persimmon's key LayerNorm adds a bias after its 1 / r_n (randomised in the tiny model): with it left out of the
    key path, the self-check stops the contributions at the key path."""
    from actlake.analysis.engine import recorder

    monkeypatch.setattr(recorder, "key_shift", lambda block, family, n_kv_heads, head_dim: None)
    ids, valid, role = batch(512)
    check = engine(zoo("persimmon"), ids, valid, role)[5]
    assert check.failures and all("the key path" in f and "contributions" in f for f in check.failures), check.failures


def test_discovery_refuses_what_it_cannot_read_in_one_line():
    from actlake.discovery import discover

    for model_type, why in [("musicgen", "num_codebooks 4 parallel audio codebook tokens per position"),
                            ("gpt_neox_japanese", "outside the transformers attention")]:
        with pytest.raises(ModelLoadError, match=rf"model_type '{model_type}' is not supported: it has no declaration, "
                                                 rf"and .*{why}"):
            discover(tiny_config(model_type))


def test_a_model_that_cannot_load_is_reported_once_without_rerun_advice(zoo, sample_corpus, tmp_path, ray_local):
    """Its config is fine (the checks before Ray pass), its weights are not: every worker's constructor fails the
    same way. The job's error leads with that reason, counts the shards, and gives no advice to rerun."""
    import shutil

    from actlake.jobs.extract.run import run_job

    folder = tmp_path / "broken"
    shutil.copytree(zoo("llama"), folder)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    cfg = job_config(folder, sample_corpus, tmp_path / "out", **{"corpus.max_docs": 16})
    with pytest.raises(ModelLoadError) as e:
        run_job(cfg)
    msg = str(e.value)
    assert msg.startswith("every worker failed to start: model ") and "cannot load" in msg, msg
    assert "(2 shard(s) not run; the same error would repeat on a rerun)" in msg and "rerun the same run id" not in msg


def test_a_discovered_layout_the_engine_cannot_run_ends_the_job_by_name(zoo, tmp_path, monkeypatch):
    """MobileBERT's keys come from a bottleneck, not from the block's input (declared with it; here a layout guessed
    without it is forced through): the engine fails on the first batch, which says the type needs a declaration
    instead of a bare tensor-shape error."""
    from actlake import model as model_module
    from actlake.errors import AnalysisError
    from actlake.jobs.extract.driver import Extractor
    from actlake.model import load_model
    from tests.integration.test_layer_replay import _windows

    guessed = Family("discovered:mobilebert", ("mobilebert",), "encoder.layer", "attention.self", "attention.self.key",
                     causal=False, rope=None)
    monkeypatch.setattr(model_module, "check_config", lambda config: guessed)
    cfg = job_config(zoo("mobilebert"), tmp_path, tmp_path / "out")
    ex = Extractor(cfg, load_model(cfg.model, lm_head=cfg.analyses.surprisal))
    with pytest.raises(AnalysisError, match=r"model_type 'mobilebert' has no declaration, and the layout read off its "
                                            r"modules does not fit it \(RuntimeError: .*needs a declaration"):
        ex.forward.run_batch(_windows(ex.lm))


def test_attention_outside_the_declared_layers_stops_the_batch_by_name(zoo, monkeypatch):
    """A module that calls the attention interface but is not among the declared attention layers (here: layer 1
    hidden from the engine) would be missing from every statistic: the batch stops, naming its class."""
    from actlake.analysis.engine import capture, recorder
    from actlake.errors import AnalysisError

    real = capture.attention_modules
    monkeypatch.setattr(recorder, "attention_modules", lambda model, family: {
        k: v for k, v in real(model, family).items() if v != 1})
    ids, valid, role = batch(512)
    with pytest.raises(AnalysisError, match=r"an attention module of the model \(LlamaAttention\) called the attention "
                                            r"interface outside the layers declared for 'llama'"):
        engine(zoo("llama"), ids, valid, role)


@pytest.mark.parametrize("model_type, no_window", [("cohere2", [False, False]), ("exaone4", [True, True])])
def test_rope_on_sliding_layers_follows_each_model_without_a_window(model_type, no_window):
    """With a window, both rotate their sliding layers only; without one, Cohere 2 rotates no layer (its attention
    rotates where it has a window) and EXAONE 4 every layer (``sliding_window is None or is_sliding``)."""
    fam = family_for(model_type)
    config = tiny_config(model_type)
    assert [fam.rope_on(config, i) for i in range(2)] == [True, False]  # layer_types: sliding, full
    config.sliding_window = None
    assert [fam.rope_on(config, i) for i in range(2)] == no_window
