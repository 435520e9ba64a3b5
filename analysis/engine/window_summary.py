"""Per-window sums of one pass, for the paired effects of interventions (``intervention_effects``).

With ``interventions:`` every pass of a batch (the clean one and each edited one) records, per window, the sums
that make its per-document means: the attention mass each key role takes, summed over the window's queries, per
attention layer and head; the residual norm summed over its tokens, per hidden state; and for causal LMs the
surprisal summed over its scored tokens and, for an edited pass, the KL divergence of its next-token
distributions from the clean pass's. :func:`cells` names the columns, the same for every pass.
"""

from __future__ import annotations

import numpy as np
import torch

from actlake.analysis.engine.device import to_device, to_host
from actlake.analysis.engine.surprisal import scored_positions, tokens_per_chunk
from actlake.categories import ROLE

MASS, NORM, SURPRISAL, KL = "attention_mass", "residual_norm", "surprisal", "kl_divergence"


def cells(attention_layers: tuple[int, ...], n_heads: int, n_hidden: int, causal: bool) -> list[tuple]:
    """(quantity, layer, head, key_category) of each column of a window's sums: attention mass per attention
    layer, head (and head -1: the mean over heads) and key role; residual norm per hidden state (head -1);
    surprisal and KL (layer and head -1)."""
    out = [(MASS, la, h, c) for la in attention_layers for h in [*range(n_heads), -1] for c in ROLE]
    out += [(NORM, la, -1, "") for la in range(n_hidden)]
    return out + ([(SURPRISAL, -1, -1, ""), (KL, -1, -1, "")] if causal else [])


class WindowSums:
    """A pass's per-window sums, filled by the recorder (attention layers), the hidden-state stream and, for an
    edited pass of a causal LM, the LM head (the KL from the clean pass's next-token distributions); a producer to
    all three (``sites``), never reduced itself. Its surprisal is the pass's per-token ``surprisal`` value."""

    name = "window_sums"
    sites = frozenset({"attention", "hidden_states", "logits"})
    products = frozenset({"mass"})
    graph_safe = False

    def __init__(self, spec, mask: torch.Tensor):
        B = mask.shape[0]
        self.layers = {la: i for i, la in enumerate(spec.attention_layers)}
        z = lambda *s: torch.zeros(*s, dtype=torch.float64, device=spec.device)
        self.mass = z(B, len(self.layers), spec.n_heads, len(ROLE))  # (B, L_att, H, C)
        self.norm = z(B, spec.n_layers + 1)  # (B, L+1)
        self.valid = to_device(mask, spec.device).double()  # (B, T)
        self.kl = None  # (B, T) an edited pass's KL from the clean pass (add_logits)

    def add_layer(self, lq) -> None:
        self.mass[:, self.layers[lq.layer]] = lq.product("mass").double().sum(2)  # (B, H, C): over valid queries

    def nonfinite_excluded(self, layer: int, count) -> None:
        """The clean statistics count them; a window's sums then lack those tokens' terms."""

    def problems(self) -> list:
        return []

    def add_hidden(self, layer: int, h: torch.Tensor, batch) -> None:
        norms = torch.linalg.vector_norm(h, dim=-1, dtype=torch.float64).to(self.valid.device)  # (B, T)
        self.norm[:, layer] = (norms * self.valid).sum(1)

    def add_logits(self, out) -> None:
        """An edited pass (``out.clean`` set): KL(p_clean || p_edited) per scored token (:func:`token_kl`)."""
        if out.clean is not None:
            self.kl = token_kl(out.head, out.clean, out.last_hidden, out.mask, transform=out.transform)

    def sums(self, values: dict, clean: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(B, K) sums and (B, K) counts on the host, in :func:`cells`' order. ``values``: the pass's per-token values
        by name, (B, T) each, whose ``surprisal`` is NaN where not scored (absent for an encoder: no surprisal or KL
        columns); the KL is this pass's (:meth:`add_logits`; zeros for the clean pass). ``clean``: for an edited
        pass, the clean pass's values: its tokens are the clean pass's scored ones, so both means are over the same
        tokens (an edit that makes a scored token's surprisal inf/NaN makes the window's sum NaN: the document
        leaves that quantity's pairs)."""
        surprisal, kl = values.get(SURPRISAL), self.kl
        scored = None if clean is None or clean.get(SURPRISAL) is None else torch.isfinite(clean[SURPRISAL])
        B = self.mass.shape[0]
        n_valid = self.valid.sum(1, keepdim=True)  # (B, 1)
        mass = torch.cat([self.mass, self.mass.mean(2, keepdim=True)], 2)  # (B, L_att, H + 1, C): and over heads
        parts = [mass.reshape(B, -1), self.norm]
        counts = [n_valid.expand(B, parts[0].shape[1]), n_valid.expand(B, parts[1].shape[1])]
        if surprisal is not None:
            s = surprisal.to(self.valid.device).double()
            scored = torch.isfinite(s) if scored is None else scored.to(self.valid.device)
            n_scored = scored.sum(1, keepdim=True).double()
            k = kl.to(self.valid.device).double() if kl is not None else torch.zeros_like(s)
            parts += [torch.where(scored, s, 0.0).sum(1, keepdim=True), torch.where(scored, k, 0.0).sum(1, keepdim=True)]
            counts += [n_scored, n_scored]
        return to_host(torch.cat(parts, 1)).numpy(), to_host(torch.cat(counts, 1)).numpy()


@torch.no_grad()
def token_kl(head: torch.nn.Module, clean: torch.Tensor, edited: torch.Tensor, mask: torch.Tensor,
             transform=None, chunk_logits: int = 1 << 24) -> torch.Tensor:
    """(B, T) KL(p_clean || p_edited) of the next-token distributions that score token t (from position t - 1),
    in nats; NaN where surprisal is not scored. ``clean``/``edited``: (B, T, d) final hidden states."""
    B, T, _ = clean.shape
    dev = clean.device
    out = torch.full((B, T), float("nan"), dtype=torch.float32, device=dev)
    if T < 2:
        return out
    flat, rows = scored_positions(mask, dev)  # the predictions surprisal scores
    hc, he = (x[:, :-1].reshape(B * (T - 1), -1)[flat] for x in (clean, edited))  # (N, d)
    kl = torch.empty(flat.shape[0], dtype=torch.float32, device=dev)
    chunk = tokens_per_chunk(head, chunk_logits)
    for s in range(0, flat.shape[0], chunk):
        lp = [torch.log_softmax((transform or (lambda x: x))(head(h[s:s + chunk]).float().to(dev)), -1)
              for h in (hc, he)]
        kl[s:s + chunk] = (lp[0].exp() * (lp[0] - lp[1])).sum(-1)
    out.view(-1)[rows] = kl
    return out
