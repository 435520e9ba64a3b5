"""Everything the analyses read from a layer's attention weights, computed in one pass.

Products (all over the batch's valid queries; padded or excluded queries give nothing):

- ``mass`` (B, H, T, C): attention each query gives each key category (METHODS.md §2);
- ``mass_keynorm`` (B, H, T, C): the same with every key rescaled to its sequence's and head's
  mean key norm (METHODS.md §4: how much of a category's attention is key norm);
- ``weighted_qsum`` (B, H, T, d_h): at each key n, sum_m alpha_mn q'_m, from which the
  attention-weighted contributions follow (METHODS.md §3);
- ``distance`` (H, 2T - 1) float64: summed weight at each m - n (index m - n + T - 1);
- ``output`` (B, H, T, d_h): alpha V, the layer's attention output (only with ``value``);
- ``sink`` (B, H, T): the share of each query's softmax that a learned sink takes (gpt-oss; METHODS.md §2), zero
  without one. With a sink, the weights over keys sum to 1 minus it, and every product above uses them as the
  model does; it comes with any explicit pass of a layer that has one.

Two ways to get them:

- :func:`explicit_products`: alpha itself, a block of sequences (and, for long windows, of
  queries) at a time, small enough to stay in cache on a CPU; every product is read off the same
  block, so the weights are computed once per layer whatever the analyses.
- :func:`fused_products`: ``mass`` and ``mass_keynorm`` only, without alpha: one fused
  attention-kernel call each with V = the one-hot key categories, O(T) memory.

On a GPU, :func:`flash_products` serves causal layers (FlashAttention, and the Triton kernels of
:mod:`~actlake.analysis.engine.kernels`), and with the kernels on, ``padded_products`` there serves
bidirectional ones (encoders) over right-padded windows.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F

from actlake.analysis.engine.heads import capped, expand_kv
from actlake.errors import ConfigError

PRODUCTS = ("mass", "mass_keynorm", "weighted_qsum", "distance", "output", "sink")
EXPLICIT_ONLY = frozenset({"weighted_qsum", "distance", "output", "sink"})
"""Products only the explicit pass gives."""
FLASH = frozenset({"output", "mass", "mass_keynorm", "weighted_qsum"})
"""Products :func:`flash_products` gives (causal attention, right padding, 16-bit q and k on CUDA)."""
TRITON = frozenset({"distance", "weighted_qsum"})
"""Products the Triton kernels of :mod:`~actlake.analysis.engine.kernels` give on the same path."""
PADDED = frozenset({"mass", "mass_keynorm", "weighted_qsum", "distance"})
"""Products the Triton kernels give for bidirectional attention over right-padded windows (encoders;
:func:`~actlake.analysis.engine.kernels.padded_products`)."""


def block_elements(device: torch.device) -> int:
    """Attention weights per block: about 2 MB on a CPU (stays in a core's L2), 256 MB on a GPU."""
    return 1 << 19 if device.type == "cpu" else 1 << 26


def key_norm_scale(lq) -> torch.Tensor:
    """(B, H, T) factor that gives every key the mean key norm of its sequence's valid keys and its head
    (1 for a zero key; padded keys get a finite factor, and no valid query sees them)."""
    norms = lq.key_norms  # (B, H, T)
    mean = (norms * lq.batch.valid_mean_weights[..., 0]).sum(-1, keepdim=True)  # (B, H, 1), float32 (not TF32)
    return torch.where(norms > 0, mean / lq.key_norms_safe, 1.0)


def diagonal_sums_from(rows: torch.Tensor) -> torch.Tensor:
    """(H, M, T) weights of queries m0 .. m0 + M - 1 -> (H, M + T - 1): entry c sums the weights with
    m - n = m0 + c - (T - 1), i.e. the block's part of the distance profile from index m0 on. Each row,
    reversed and padded, is read with a stride one shorter than its length (the "skew" of a matrix),
    which lines up the diagonals as columns: no scatter, no atomics."""
    H, M, T = rows.shape
    padded = F.pad(rows.flip(-1), (0, M))  # (H, M, T + M): row i, column c holds the weight at n = T - 1 - c
    skewed = padded.reshape(H, -1)[:, : M * (T + M - 1)].reshape(H, M, T + M - 1)  # row i shifted right by i
    return skewed.sum(1, dtype=torch.float64)


def softmax_with_sinks(logits: torch.Tensor, sinks: torch.Tensor | None) -> tuple:
    """(weights (..., H, M, T), the sink's share (..., H, M) or None): the softmax of each row of ``logits``
    (..., H, M, T) with one more logit per head, ``sinks`` (H,), that no key owns (dropped from the weights, as
    the model's kernel drops it), or the plain softmax without sinks."""
    if sinks is None:
        return torch.softmax(logits, dim=-1), None
    s = sinks.to(logits.dtype)[:, None]  # (H, 1): against (..., H, M)
    total = torch.logaddexp(torch.logsumexp(logits, dim=-1), s)  # (..., H, M): log of each row's normaliser
    return torch.exp(logits - total[..., None]), torch.exp(s - total)


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
        self.names, self.batch = names, lq.batch
        self.k = lq.key_per_query_head  # (B, H, T, d_h)
        self.q = lq.query * lq.scaling  # the softmax scale folded into q once
        self.softcap, self.sinks = lq.softcap, lq.sinks
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
                onehot8 = self.batch.padded_key_onehot(8)
                self.v = torch.cat([self.v, onehot8[:, None].expand(B, H, T, onehot8.shape[-1])], dim=-1)
            self.out_v = new(B, H, T, self.v.shape[-1])
        self.mass_buf = self.keynorm_buf = None
        if ("mass" in names and not self.mass_in_output) or "mass_keynorm" in names:
            self.onehot16 = self.batch.padded_key_onehot(16)  # (B, T, 16)
            width = self.onehot16.shape[-1]
            if "mass" in names and not self.mass_in_output:
                self.mass_buf = new(B, H, T, width)
            if "mass_keynorm" in names:
                self.keynorm_buf = new(B, H, T, width)
                self.kscale = key_norm_scale(lq)[:, :, None, :]  # (B, H, 1, T)
        if "weighted_qsum" in names:  # invalid queries give nothing: zero rows of q
            self.qv = lq.valid_query
            self.wq = torch.zeros_like(self.q) if self.mb < T else new(B, H, T, dh)
        if "distance" in names:
            self.distance = torch.zeros(H, 2 * T - 1, dtype=torch.float64, device=self.q.device)
            self.diag = self.batch.distance_index(T)
        if self.sinks is not None or "sink" in names:  # the sink's share comes with every pass of a layer with one
            self.names.add("sink")
            self.sink_buf = self.q.new_zeros(B, H, T)

    def run(self) -> dict:
        T = self.T
        for m0 in range(0, T, self.mb):
            m = slice(m0, min(T, m0 + self.mb))
            dist = self.q.new_zeros(self.H, m.stop - m0, T) if "distance" in self.names else None
            for s0 in range(0, self.B, self.sb):
                self._block(slice(s0, min(self.B, s0 + self.sb)), m, dist)
            if dist is not None and dist.device.type == "cpu":
                self.distance.index_add_(1, self.diag[m].reshape(-1), dist.reshape(self.H, -1).double())
            elif dist is not None:  # on a GPU, index_add_ into 2T - 1 bins is atomics contending
                span = diagonal_sums_from(dist)
                self.distance[:, m0 : m0 + span.shape[1]] += span
        return self._results()

    def _block(self, s: slice, m: slice, dist) -> None:
        """Sequences s, queries m: every product of their weights. ``dist`` (H, mb, T) sums over sequences."""
        batch, names = self.batch, self.names
        raw = torch.matmul(self.q[s, :, m], self.k[s].transpose(-1, -2))  # (b, H, mb, T)
        logits = capped(raw, self.softcap)  # the model's softcapping, when it has one
        if any(batch.needs_mask[s]):
            logits.add_(batch.weight_mask_additive[s, :, m])
        if self.keynorm_buf is not None:  # rescaling key n rescales its scores (before any cap)
            logits_kn = capped(raw * self.kscale[s], self.softcap) if self.softcap else logits * self.kscale[s]
        del raw
        alpha, sink = softmax_with_sinks(logits, self.sinks)
        del logits
        if sink is not None:
            self.sink_buf[s, :, m] = sink
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
            if not any(batch.has_invalid[s]):
                dist += alpha.sum(0)
            else:
                dist += alpha.mul_(batch.validf[s, None, m, None]).sum(0)
        del alpha
        if self.keynorm_buf is not None:
            self._category_mass(self.keynorm_buf, s, m, softmax_with_sinks(logits_kn, self.sinks)[0])

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
        if "sink" in names:
            out["sink"] = self.sink_buf * self.batch.validf[:, None, :]
        return out


def flash_products(lq, names) -> dict:
    """``FLASH`` products from FlashAttention kernels, without the T x T weights in memory.

    For causal attention over right-padded windows on CUDA, with q, k, v in the model's 16-bit dtype
    (``lq.native``): every valid query sees only valid keys, so the causal kernel needs no mask.

    - ``output``: the kernel's forward pass (what the model's SDPA call computes);
    - ``weighted_qsum``: the kernel's backward pass with dO = q on valid queries gives
      dV_n = sum_m alpha_mn q_m, exactly the sum wanted (dQ and dK are computed and dropped);
    - ``mass``: the forward pass with V = the one-hot key categories (METHODS.md §2);
    - ``mass_keynorm``: the same with keys rescaled to their sequence's mean norm, in float16 (the
      rescaled keys are not exact in bfloat16; 2^-11 relative instead of 2^-8).
    - with ``lq.triton``, ``weighted_qsum`` and ``distance`` (:data:`TRITON`) instead come from the Triton
      kernels of :mod:`~actlake.analysis.engine.kernels`, given the log-sum-exp of the forward call for
      the output or the mass (or of one made for them): no backward pass.

    Outputs are rounded to the kernel's dtype (bfloat16: 2^-9 relative per entry), then summed in
    float64 by the analyses; padded queries give nothing.
    """

    flash = torch.ops.aten._scaled_dot_product_flash_attention
    q, k, v = lq.native
    H, C = q.shape[1], lq.key_onehot.shape[-1]
    k = expand_kv(k, H)
    valid = lq.batch.validf[:, None, :, None]
    scale = float(lq.scaling)
    out, lse = {}, None
    names = set(names)
    kernels = names & TRITON if lq.triton else set()
    if "output" in names or "weighted_qsum" in names - kernels or (kernels and "mass" not in names):
        v = expand_kv(v, H) if v is not None else torch.zeros_like(q)
        o, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = flash(q, k, v, 0.0, True, False, scale=scale)
        out["output"] = o
        if "weighted_qsum" in names - kernels:
            grad = q * valid.to(q.dtype)
            _, _, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                grad, q, k, v, o, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset, scale=scale)
            out["weighted_qsum"] = dv.float()
    if {"mass", "mass_keynorm"} & set(names):
        B, _, T, dh = q.shape
        if "mass" in names:
            onehot = lq.batch.padded_key_onehot(dh, q.dtype)  # (B, T, d_h)
            o, lse_mass = flash(q, k, onehot[:, None].expand(B, H, T, dh), 0.0, True, False, scale=scale)[:2]
            out["mass"] = o[..., :C].float() * valid
            lse = lse_mass if lse is None else lse
        if "mass_keynorm" in names:
            onehot = lq.batch.padded_key_onehot(dh, torch.float16)
            k16 = (k.float() * key_norm_scale(lq)[..., None]).half()
            o = flash(q.half(), k16, onehot[:, None].expand(B, H, T, dh), 0.0, True, False, scale=scale)[0]
            out["mass_keynorm"] = o[..., :C].float() * valid
    if kernels:  # the weights again, tile by tile, from the log-sum-exp of a forward call above
        from actlake.analysis.engine.kernels import (  # kernels imports this module: imported when used
            layer_products,  # imports triton, installed only where kernels run
        )

        out.update(layer_products(lq, kernels, lse))
    return {n: out[n] for n in names}


def flash_applies(lq_query: torch.Tensor, batch) -> bool:
    """Whether :func:`flash_products` can serve this layer: CUDA with FlashAttention (compute capability 8.0
    or newer), 16-bit q, head size a multiple of 8 up to 256, causal, right padding."""
    return (lq_query.device.type == "cuda" and lq_query.dtype in (torch.bfloat16, torch.float16)
            and batch.causal and batch.lengths is not None and lq_query.shape[-1] <= 256
            and lq_query.shape[-1] % 8 == 0 and ampere_or_newer(lq_query.device))


def padded_applies(lq_query: torch.Tensor, batch) -> bool:
    """Whether :func:`~actlake.analysis.engine.kernels.padded_products` can serve this layer (with the Triton
    kernels on): CUDA, compute capability 8.0 or newer, 16-bit q, bidirectional, right padding."""
    return (lq_query.device.type == "cuda" and lq_query.dtype in (torch.bfloat16, torch.float16)
            and not batch.causal and batch.lengths is not None and lq_query.shape[-1] <= 256
            and ampere_or_newer(lq_query.device))


@functools.lru_cache
def ampere_or_newer(device: torch.device) -> bool:
    """Compute capability 8.0 or newer (FlashAttention's kernels, Triton's bfloat16 products); asked once
    per device. True where CUDA is not present to ask (tests that only name a CUDA device)."""
    if not torch.cuda.is_available():
        return True
    return torch.cuda.get_device_capability(device) >= (8, 0)


def triton_kernels_on(setting: bool | None, device: torch.device) -> bool:
    """Whether this worker uses the Triton kernels of :mod:`~actlake.analysis.engine.kernels`
    (``analyses.triton_kernels``): on a CUDA device of compute capability 8.0 or newer with the package
    installed, unless ``setting`` is False. True where they cannot run is a ConfigError. (The attention kernels serve only the layers
    :func:`flash_products` serves.)"""
    installed = importlib.util.find_spec("triton") is not None
    if setting and device.type != "cuda":
        raise ConfigError(f"analyses.triton_kernels: true needs a CUDA device; this worker has {device.type} "
                          "(set it to null or false)")
    if device.type == "cuda" and not ampere_or_newer(device):
        if setting:
            raise ConfigError(f"analyses.triton_kernels: true needs a GPU of compute capability 8.0 or newer; "
                              f"{device} has {torch.cuda.get_device_capability(device)} (set it to null or false)")
        return False
    if setting and not installed:
        raise ConfigError("analyses.triton_kernels: true needs the triton package on the workers (pip install "
                          "triton); set it to null or false")
    return setting is not False and device.type == "cuda" and installed


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
