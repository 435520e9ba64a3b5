"""The engine against float64 eager transformers on one model folder: every default analysis's numbers, a few
padded windows, in process. Used by tests/integration/test_families.py and benchmarks/model_zoo.py.

Reference (independent of the engine's algebra): the model in float64 with eager attention, its own attention
weights (``output_attentions``), hidden states, logits, and the q and k its attention calls receive. Compared:
residual norms, attention mass per key category, ||q|| and ||k|| sums (geometry), the distance profile, the
contributions' sum rule (sum_j C_j + bias term = q'.k' summed over valid pairs, per key category), and surprisal.
"""

from __future__ import annotations

import torch

from actlake.analysis.attention_distance import AttentionByDistance
from actlake.analysis.attention_mass import AttentionMass
from actlake.analysis.contributions import QUERY_GROUPS_ALL, Contributions
from actlake.analysis.engine import capture
from actlake.architectures import attention_calls
from actlake.analysis.engine.recorder import AttentionRecorder, ModelQK
from actlake.analysis.engine.selfcheck import SelfCheck
from actlake.analysis.geometry import Geometry
from actlake.analysis.engine.surprisal import token_surprisal
from actlake.categories import ROLE, one_hot
from actlake.config import ModelConfig
from actlake.model import load_model

QUANTITIES = ("residual_norms", "attention_mass", "geometry", "distance", "contributions", "surprisal")


def batch(vocab: int, seed: int = 0, B: int = 3, T: int = 24):
    """(ids, valid, role): random tokens, right padding on two rows, random key categories."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, min(vocab, 500), (B, T), generator=g)
    valid = torch.ones(B, T, dtype=torch.long)
    valid[1, T - 7 :] = 0
    valid[2, T // 3 :] = 0
    role = torch.randint(0, len(ROLE), (B, T), generator=g)
    return ids, valid, role


class _Keep:
    """A recorder that keeps each layer's q and k as the kernel receives them (the reference's), and for a layer
    with learned sinks its weights brute force: some kernels return weights without the sink's share (Granite
    SWA scales the output instead), so ``output_attentions`` is not the weights the model uses there."""

    def __init__(self, layer_of, calls=None):
        self.layer_of, self.qk, self.sink_weights = layer_of, {}, {}
        self.calls = calls  # call-order layers: the k-th call is layer k (its own attentions follow the calls)

    def on_attention(self, module, query, key, scaling, attention_mask=None, is_causal=None, value=None, softcap=None,
                     sliding_window=None, sinks=None):
        layer = self.layer_of[id(module)] if self.calls is None else len(self.qk)
        q, k = query.detach().double(), key.detach().double()
        self.qk[layer] = (q, k, sliding_window)
        if sinks is not None:
            logits = q @ k.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2) * scaling
            if attention_mask is not None:
                mask = attention_mask[..., -q.shape[2]:, -k.shape[2]:]
                logits = (logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool
                          else logits + mask.double())
            sink = sinks.detach().double()[None, :, None, None].expand(*logits.shape[:3], 1)
            self.sink_weights[layer] = torch.softmax(torch.cat([logits, sink], -1), -1)[..., :-1]
        return None


def reference(folder: str, ids, valid):
    """Float64 eager: (hidden states, attention weights and q/k per attention layer, logits or None)."""
    lm = load_model(ModelConfig(name_or_path=folder, attn_implementation="eager", dtype="float32"), lm_head=None)
    model = (lm.causal_lm or lm.model).double()
    if getattr(model.config, "_experts_implementation", None) not in (None, "eager"):
        model.set_experts_implementation("eager")  # grouped matrix products have no float64 kernel
    capture.install(model)
    keep = _Keep(capture.attention_modules(lm.model, lm.family), attention_calls(model.config.get_text_config()))
    with torch.no_grad(), capture.recording(keep):
        out = model(input_ids=ids, attention_mask=valid, output_attentions=True, output_hidden_states=True,
                    use_cache=False)
    logits = out.logits if lm.causal_lm is not None else None
    layers = sorted(keep.qk)  # a hybrid's attention layers only
    own = list(out.attentions)
    if len(own) != len(out.hidden_states) - 1:  # weights of the attention layers only (not one entry per block)
        own = dict(zip(layers, [a for a in own if a is not None]))
    alphas = {i: keep.sink_weights.get(i, own[i]) for i in layers}
    return out.hidden_states, alphas, keep.qk, logits, lm


def engine(folder: str, ids, valid, role, attn: str = "sdpa"):
    """The engine in float32, as a worker runs it: (norms per layer list, analyses, surprisal, self-check)."""
    lm = load_model(ModelConfig(name_or_path=folder, attn_implementation=attn, dtype="float32"), lm_head=None)
    capture.install(lm.model)
    mqk = ModelQK(lm.model, lm.family)
    L, H, d = mqk.n_layers, mqk.n_heads, lm.model.config.get_text_config().hidden_size
    geo, dist = Geometry.zeros(L, H), AttentionByDistance.zeros(L, H, ids.shape[1])
    con = Contributions.zeros(L, H, d, QUERY_GROUPS_ALL)
    analyses = [geo, dist, con, AttentionMass.zeros(L, H)]
    hidden = {}
    check = SelfCheck(torch.float32, ["attention_geometry", "attention_by_distance", "contributions"], ["contributions"],
                      ["residual_norms"])
    with capture.LayerInputs(lm.model, lm.family) as inputs, capture.HiddenStream(lm.model, lm.family) as stream:
        rec = AttentionRecorder(mqk, valid, one_hot(role, len(ROLE), valid), [a.add_layer for a in analyses],
                                inputs=inputs, needs={"weighted_qsum", "distance", "mass_keynorm"})
        rec.check = check
        stream(lambda layer, h: hidden.__setitem__(layer, h.double()))
        with torch.no_grad(), capture.recording(rec):
            out = lm.model(input_ids=ids, attention_mask=valid, use_cache=False)
        stream.last(out.last_hidden_state)
    check.layers(mqk.attention_layers, rec.seen)
    surprisal = None
    if lm.lm_head is not None:
        surprisal = token_surprisal(lm.lm_head, out.last_hidden_state, ids, valid, transform=lm.logit_transform)
    # as a worker's first batch (analysis/engine/forward.py): the model's own pass on the first sequence, the block
    # hooks on, against its output_hidden_states and logits
    n, hooked = int(valid[0].sum()), {}
    model = lm.causal_lm if lm.causal_lm is not None else lm.model
    with torch.no_grad(), capture.HiddenStream(lm.model, lm.family) as hooks:
        hooks(lambda layer, h: hooked.__setitem__(layer, h[0]))
        own = model(input_ids=ids[:1, :n], output_hidden_states=True, use_cache=False)
        hooks.last(getattr(own, "last_hidden_state", None) if model is lm.model else own.hidden_states[-1])
    check.hidden_states(hooked, own.hidden_states)
    if surprisal is not None:
        check.surprisal(surprisal[0, :n], own.logits[0], ids[0, :n], valid[0, :n])
    return hidden, geo, dist, con, surprisal, check, lm, analyses[-1]


def relative(a, b) -> float:
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def compare(folder: str, seed: int = 0, attn: str = "sdpa", T: int = 24) -> dict:
    """{quantity: largest error relative to the largest reference value} for one model folder; ``self_check``:
    the engine's own first-batch check failures (a list)."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(folder).get_text_config().vocab_size  # a multimodal config's text model's
    ids, valid, role = batch(vocab, seed, T=T)
    hs, alphas, qk, logits, _ = reference(folder, ids, valid)
    hidden, geo, dist, con, surprisal, check, lm, am = engine(folder, ids, valid, role, attn)
    v = valid.double()
    kcat = one_hot(role, len(ROLE), valid).double()  # (B, T, C)
    err = {"residual_norms": max(relative(hidden[i].norm(dim=-1) * v, hs[i].norm(dim=-1) * v) for i in range(len(hs)))}
    mass, qn, kn, dst, rule = [], [], [], [], []
    T = ids.shape[1]
    for layer, alpha in alphas.items():
        a = alpha * v[:, None, :, None]  # valid queries only
        want = torch.einsum("bhmn,bnc->hc", a, kcat)
        sink = ((1 - alpha.sum(-1)) * v[:, None]).sum((0, 2))  # (H,) what a learned sink took (0 without one)
        mass.append(relative(geo.mass[layer], want))
        mass.append(relative(torch.cat([am.mass[layer].sum(1), am.sink[layer].sum(-1, keepdim=True)], -1),
                             torch.cat([want, sink[:, None]], -1)))
        q, k, window = qk[layer]  # the window the model's own attention call was handed
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        causal = lm.family.causal
        pairs = v[:, None, :, None] * v[:, None, None, :]  # (B, 1, T, T)
        if causal:
            pairs = pairs * torch.ones(T, T, dtype=torch.float64).tril()
        if window is not None:
            m = torch.arange(T)
            pairs = pairs * ((m[:, None] - m[None, :]).abs() < window)
        kcount = pairs.sum(2)  # (B, 1, T): valid queries that see each key
        qn.append(relative(geo.k_norm[layer], torch.einsum("bht,bt,bht,btc->hc", kcount.expand_as(k[..., 0]), v,
                                                           k.norm(dim=-1), kcat)))
        scores = torch.einsum("bhmd,bhnd->bhmn", q, k) * pairs  # q'.k' over valid pairs
        want = torch.einsum("bhmn,bnc->hc", scores, kcat)
        got = con.contrib[layer, :, 0].double().sum(-1) + con.bias[layer, :, 0].double()
        rule.append(relative(got, want))
        m = torch.arange(T)
        delta = (m[:, None] - m[None, :] + T - 1)  # (T, T)
        ref = torch.zeros(alpha.shape[1], 2 * T - 1, dtype=torch.float64).index_add_(
            1, delta.reshape(-1), (a * pairs).sum(0).reshape(alpha.shape[1], -1))
        dst.append(relative(dist.attn[layer], ref))
    if alphas:  # none recorded: the self-check's layer count says so (a job stops there)
        err.update(attention_mass=max(mass), geometry=max(qn), distance=max(dst), contributions=max(rule))
    if logits is not None:
        lp = torch.log_softmax(logits, -1)[:, :-1].gather(2, ids[:, 1:, None])[..., 0]
        keep = (valid[:, 1:] * valid[:, :-1]).bool()
        err["surprisal"] = relative(surprisal[:, 1:][keep], -lp[keep])
    err["self_check"] = check.failures
    return err
