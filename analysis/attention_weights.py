"""Everything the analyses read from a layer's attention weights, computed in one pass.

Products (all over the batch's valid queries; padded or excluded queries give nothing):

- ``mass`` (B, H, T, C): attention each query gives each key category (METHODS.md §2);
- ``mass_keynorm`` (B, H, T, C): the same with every key rescaled to its sequence's and head's
  mean key norm (METHODS.md §4: how much of a category's attention is key norm);
- ``weighted_qsum`` (B, H, T, d_h): at each key n, sum_m alpha_mn q'_m, from which the
  attention-weighted contributions follow (METHODS.md §3);
- ``distance`` (H, 2T - 1) float64: summed weight at each m - n (index m - n + T - 1);
- ``output`` (B, H, T, d_h): alpha V, the layer's attention output (only with ``value``).

Two ways to get them:

- :func:`explicit_products`: alpha itself, a block of sequences (and, for long windows, of
  queries) at a time, small enough to stay in cache on a CPU; every product is read off the same
  block, so the weights are computed once per layer whatever the analyses.
- :func:`fused_products`: ``mass`` and ``mass_keynorm`` only, without alpha: one fused
  attention-kernel call each with V = the one-hot key categories, O(T) memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PRODUCTS = ("mass", "mass_keynorm", "weighted_qsum", "distance", "output")
EXPLICIT_ONLY = frozenset({"weighted_qsum", "distance", "output"})
"""Products only the explicit pass gives."""


def block_elements(device: torch.device) -> int:
    """Attention weights per block: about 2 MB on a CPU (stays in a core's L2), 256 MB on a GPU."""
    return 1 << 19 if device.type == "cpu" else 1 << 26


def key_norm_scale(lq) -> torch.Tensor:
    """(B, H, T) factor that gives every valid key the mean key norm of its sequence and head."""
    norms = lq.key_norms  # (B, H, T)
    v = lq.batch.validf[:, None, :]
    mean = (norms * v).sum(-1, keepdim=True) / v.sum(-1, keepdim=True).clamp(min=1)
    return torch.where(norms > 0, mean / norms.clamp(min=1e-30), torch.ones_like(norms)) * v + (1 - v)


def _distance_index(T: int, device) -> torch.Tensor:
    """(T, T) long: m - n + T - 1 for query m and key n."""
    m = torch.arange(T, device=device)
    return m[:, None] - m[None, :] + (T - 1)


def _padded_onehot(onehot: torch.Tensor, width: int) -> torch.Tensor:
    """(B, T, C) -> (B, T, width) float32, zero columns added: matrix kernels are much faster on a
    product 8 or 16 wide than 5 wide."""
    out = onehot.new_zeros(*onehot.shape[:2], max(width, onehot.shape[-1]), dtype=torch.float32)
    out[..., : onehot.shape[-1]] = onehot
    return out


def explicit_products(lq, names, value: torch.Tensor | None = None, max_elements: int | None = None) -> dict:
    """The requested products from explicit weights, block by block.

    ``value`` (B, H_kv, T, d_v) float32 is needed for ``output``. ``max_elements`` bounds a block of
    weights (default :func:`block_elements`).
    """
    names = set(names)
    if names - set(PRODUCTS):
        raise ValueError(f"unknown attention products {sorted(names - set(PRODUCTS))}")
    if "output" in names and value is None:
        raise ValueError("the attention output needs the layer's value tensor")
    return _ExplicitPass(lq, names, value, max_elements or block_elements(lq.query.device)).run()


class _ExplicitPass:
    """One layer's weights, a block of sequences (and queries) at a time. Per block: one product for
    the logits, a softmax, and one product per reading, written straight into its result buffer; the
    category masses ride along with the output (V = [value | one-hot]) when both are wanted."""

    def __init__(self, lq, names: set, value, budget: int):
        from actlake.analysis.attention_mass import expand_kv

        self.names, self.batch = names, lq.batch
        self.k = lq.key_per_query_head  # (B, H, T, d_h)
        self.q = lq.query * lq.scaling  # the softmax scale folded into q once
        B, H, T, dh = self.q.shape
        self.B, self.H, self.T, self.dh, self.C = B, H, T, dh, lq.key_onehot.shape[-1]
        self.mb = T if H * T * T <= budget else max(1, budget // (H * T))  # queries per block
        self.sb = max(1, budget // (H * self.mb * T))  # sequences per block
        new = self.q.new_empty
        self.mass_in_output = {"output", "mass"} <= names
        if "output" in names:
            self.v = expand_kv(value, H)  # (B, H, T, d_v)
            self.dv = self.v.shape[-1]  # value heads may be narrower or wider than query heads
            if self.mass_in_output:
                onehot8 = _padded_onehot(lq.key_onehot, 8)
                self.v = torch.cat([self.v, onehot8[:, None].expand(B, H, T, onehot8.shape[-1])], dim=-1)
            self.out_v = new(B, H, T, self.v.shape[-1])
        self.mass_buf = self.keynorm_buf = None
        if ("mass" in names and not self.mass_in_output) or "mass_keynorm" in names:
            self.onehot16 = _padded_onehot(lq.key_onehot, 16)  # (B, T, 16)
            width = self.onehot16.shape[-1]
            if "mass" in names and not self.mass_in_output:
                self.mass_buf = new(B, H, T, width)
            if "mass_keynorm" in names:
                self.keynorm_buf = new(B, H, T, width)
                self.kscale = key_norm_scale(lq)[:, :, None, :]  # (B, H, 1, T)
        if "weighted_qsum" in names:  # invalid queries give nothing: zero rows of q
            self.qv = lq.query * self.batch.validf[:, None, :, None] if any(self.batch.has_invalid) else lq.query
            self.wq = torch.zeros_like(self.q) if self.mb < T else new(B, H, T, dh)
        if "distance" in names:
            self.distance = torch.zeros(H, 2 * T - 1, dtype=torch.float64, device=self.q.device)
            self.diag = _distance_index(T, self.q.device)

    def run(self) -> dict:
        T = self.T
        for m0 in range(0, T, self.mb):
            m = slice(m0, min(T, m0 + self.mb))
            dist = self.q.new_zeros(self.H, m.stop - m0, T) if "distance" in self.names else None
            for s0 in range(0, self.B, self.sb):
                self._block(slice(s0, min(self.B, s0 + self.sb)), m, dist)
            if dist is not None:
                self.distance.index_add_(1, self.diag[m].reshape(-1), dist.reshape(self.H, -1).double())
        return self._results()

    def _block(self, s: slice, m: slice, dist) -> None:
        """Sequences s, queries m: every product of their weights. ``dist`` (H, mb, T) sums over sequences."""
        batch, names = self.batch, self.names
        logits = torch.matmul(self.q[s, :, m], self.k[s].transpose(-1, -2))  # (b, H, mb, T)
        if any(batch.needs_mask[s]):
            logits.add_(batch.weight_mask_additive[s, :, m])
        if self.keynorm_buf is not None:
            logits_kn = logits * self.kscale[s]  # rescaling key n rescales its logits; -inf stays -inf
        alpha = torch.softmax(logits, dim=-1)
        del logits
        if "output" in names:
            self._product(self.out_v, s, m, alpha, self.v[s])  # (b, H, mb, d_h [+ 8])
        if self.mass_buf is not None:
            self._category_mass(self.mass_buf, s, m, alpha)
        if "weighted_qsum" in names:  # rows of invalid queries meet zero rows of qv
            if self.mb == self.T:
                torch.matmul(alpha.transpose(-1, -2), self.qv[s], out=self.wq[s])
            else:
                self.wq[s] += torch.matmul(alpha.transpose(-1, -2), self.qv[s, :, m])
        if dist is not None:  # summed over the block's sequences, their valid queries only
            lengths = batch.lengths
            if not any(batch.has_invalid[s]):
                dist += alpha.sum(0)
            elif lengths is not None:  # valid queries are a prefix: add each sequence's rows
                for i, n in enumerate(lengths[s]):
                    dist[:, : max(0, n - m.start)] += alpha[i, :, : max(0, n - m.start)]
            else:
                dist += alpha.mul_(batch.validf[s, None, m, None]).sum(0)
        del alpha
        if self.keynorm_buf is not None:
            self._category_mass(self.keynorm_buf, s, m, torch.softmax(logits_kn, dim=-1))

    def _product(self, buf, s, m, a, b) -> None:
        """buf[s, :, m] = a @ b, written in place when blocks hold whole sequences."""
        if self.mb == self.T:
            torch.matmul(a, b, out=buf[s])
        else:
            buf[s, :, m] = torch.matmul(a, b)

    def _category_mass(self, buf, s, m, a) -> None:
        """buf[s, :, m] = a @ one-hot categories (16 wide): one product per sequence over all heads."""
        if self.mb == self.T:
            n, width = s.stop - s.start, buf.shape[-1]
            torch.bmm(a.view(n, -1, self.T), self.onehot16[s], out=buf[s].view(n, -1, width))
        else:
            buf[s, :, m] = torch.matmul(a, self.onehot16[s, None])

    def _results(self) -> dict:
        names, C = self.names, self.C
        valid_q = self.batch.validf[:, None, :, None]  # padded / excluded queries give nothing
        out: dict[str, torch.Tensor] = {}
        if "output" in names:
            out["output"] = self.out_v[..., : self.dv]
        if "mass" in names:
            mass = self.out_v[..., self.dv : self.dv + C] if self.mass_in_output else self.mass_buf[..., :C]
            out["mass"] = mass * valid_q
        if "mass_keynorm" in names:
            out["mass_keynorm"] = self.keynorm_buf[..., :C] * valid_q
        if "weighted_qsum" in names:
            out["weighted_qsum"] = self.wq
        if "distance" in names:
            out["distance"] = self.distance
        return out


def fused_products(lq, names) -> dict:
    """``mass`` / ``mass_keynorm`` through the fused kernel with one-hot V; nothing else."""
    names = set(names)
    if names - {"mass", "mass_keynorm"}:
        raise ValueError(f"{sorted(names - {'mass', 'mass_keynorm'})} need explicit attention weights")
    out = {}
    k = lq.key_per_query_head
    v = lq.batch.validf[:, None, :, None]
    if "mass" in names:
        out["mass"] = one_hot_value_mass(lq.query, k, lq.scaling, lq.batch.weight_mask, lq.key_onehot) * v
    if "mass_keynorm" in names:
        k = k * key_norm_scale(lq)[..., None]
        out["mass_keynorm"] = one_hot_value_mass(lq.query, k, lq.scaling, lq.batch.weight_mask, lq.key_onehot) * v
    return out


def one_hot_value_mass(query, key, scaling, pair_mask, key_onehot) -> torch.Tensor:
    """(B, H, T, C): for each query, the attention it gives to each key category, without alpha.

    One fused kernel call with V = the one-hot key categories, zero-padded to the head size:
    kernels such as the CPU flash kernel need V as wide as q and k, and fall back to a
    materialising path otherwise. ``key`` has one head per query head.
    """
    q, k = query.float(), key.float()
    B, H, T, E = q.shape
    C = key_onehot.shape[-1]
    outs = []
    for c0 in range(0, C, E):
        cols = key_onehot[..., c0 : c0 + E].float()
        v = torch.zeros(B, T, E, device=q.device)
        v[..., : cols.shape[-1]] = cols
        o = F.scaled_dot_product_attention(q, k, v[:, None].expand(B, H, T, E), attn_mask=pair_mask, scale=float(scaling))
        outs.append(o[..., : cols.shape[-1]])
    return torch.cat(outs, dim=-1)
