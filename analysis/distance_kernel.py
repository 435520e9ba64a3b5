"""The distance profile (METHODS.md §4) of causal attention without the T x T weights: a Triton kernel.

For every head h and distance d = m - n >= 0, the profile sums alpha_mn over the batch's valid
queries m. The weights are rebuilt tile by tile from q, k and the softmax's log-sum-exp per query
(which the FlashAttention forward pass returns anyway): alpha = exp(scale q.k - lse), the same
formula, in the same precision, as the kernel that computed the layer's output.

Grouping by m - n inside a tile has no matrix form, so the kernel does not do it. Instead, one
program per (sequence, head, block diagonal D) walks the tiles (query block I, key block I - D),
whose entry (i, j) always lies at distance D * BLOCK + i - j, and adds them up elementwise on tensor
cores' outputs (no atomics, no scratch memory). What leaves the kernel is one BLOCK x BLOCK tile per
(sequence, head, D): B * H * T * BLOCK floats (Pythia-410m, 16 windows of 1,024 tokens: 64 MB),
which PyTorch sums over the sequences and then along its diagonals (a handful of small operations).

The cost is half a causal QK^T product per layer (tiles above the diagonal are skipped), against a
float32 logits matrix, its mask, softmax and sums over the whole T x T in memory for the blocked path.

CPU tests run the same kernel through Triton's interpreter (:func:`distance_profile` does so for
CPU tensors), on small shapes, against the explicit weights.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from actlake.analysis.attention_weights import diagonal_sums_from, explicit_products
from actlake.errors import AnalysisError

LOG2E = 1.4426950408889634
AGREEMENT = 1e-2
"""Largest |kernel - explicit weights| / largest value allowed at the first layer a process runs on a
device; bfloat16 inputs put the two about 1e-5 apart, a wrong log-sum-exp convention or a miscompiled
kernel by far more."""
_verified: set = set()  # devices whose kernel output matched the explicit weights in this process


@triton.jit
def _distance_tiles(q_ptr, k_ptr, lse_ptr, valid_ptr, out_ptr,
                    n_heads, kv_group, T, n_blocks,
                    sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d, sl_b, sl_h, sl_t, sv_b, sv_t,
                    scale_log2e,
                    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, DOT_F32: tl.constexpr):
    """Program (b * H + h, D): out[b, h, D] = sum over query blocks I >= D of the (BLOCK, BLOCK) tile of
    weights of queries I * BLOCK + i and keys (I - D) * BLOCK + j, zero where n > m, m >= T or the
    query is not valid. ``DOT_F32``: multiply in float32 (the interpreter's bfloat16 products are wrong;
    bfloat16 products are exact in float32, so only the order of the sums differs)."""
    bh = tl.program_id(0).to(tl.int64)  # offsets in 64 bits: large batches pass 2^31 elements
    D = tl.program_id(1)
    b = bh // n_heads
    h = bh % n_heads
    hk = h // kv_group
    i = tl.arange(0, BLOCK)
    c = tl.arange(0, D_PAD)
    in_head = c < HEAD_DIM
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for I in range(D, n_blocks):
        m = I * BLOCK + i  # (BLOCK,) query positions
        n = (I - D) * BLOCK + i  # (BLOCK,) key positions
        q = tl.load(q_ptr + b * sq_b + h * sq_h + m[:, None] * sq_t + c[None, :] * sq_d,
                    mask=(m[:, None] < T) & in_head[None, :], other=0.0)  # (BLOCK, D_PAD)
        k = tl.load(k_ptr + b * sk_b + hk * sk_h + n[:, None] * sk_t + c[None, :] * sk_d,
                    mask=(n[:, None] < T) & in_head[None, :], other=0.0)  # (BLOCK, D_PAD)
        lse = tl.load(lse_ptr + b * sl_b + h * sl_h + m * sl_t, mask=m < T, other=0.0)  # (BLOCK,)
        valid = tl.load(valid_ptr + b * sv_b + m * sv_t, mask=m < T, other=0.0)  # (BLOCK,)
        if DOT_F32:
            q, k = q.to(tl.float32), k.to(tl.float32)
        s = tl.dot(q, tl.trans(k))  # (BLOCK, BLOCK), float32 accumulation
        p = tl.exp2(s * scale_log2e - lse[:, None] * 1.4426950408889634)
        keep = (m[:, None] >= n[None, :]) & (valid[:, None] > 0)
        acc += tl.where(keep, p, 0.0)
    tl.store(out_ptr + ((bh * n_blocks + D) * BLOCK + i[:, None]) * BLOCK + i[None, :], acc)


def block_size(T: int) -> int:
    """Queries (and keys) per tile: 64, or less for short windows (at least 16, what tl.dot needs)."""
    return max(16, min(64, triton.next_power_of_2(T)))


def distance_profile(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, validf: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """(H, 2T - 1) float64: summed causal attention weight at each m - n (index m - n + T - 1), over the
    valid queries of the batch; zero at negative distances.

    ``q`` (B, H, T, d_h) and ``k`` (B, H_kv, T, d_h) as the attention kernel received them (16-bit on a
    GPU); ``lse`` (B, H, T) float32, log sum_n exp(scale q_m . k_n) over the keys query m sees;
    ``validf`` (B, T) 1.0 for valid queries. Right padding is assumed (valid queries see only valid keys),
    as for the FlashAttention path this serves.
    """
    B, H, T, dh = q.shape
    BL = block_size(T)
    n_blocks = -(-T // BL)
    tiles = torch.empty(B, H, n_blocks, BL, BL, dtype=torch.float32, device=q.device)
    if q.device.type != "cuda" and not interpreted():
        raise ValueError("the Triton distance kernel runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (tests)")
    _distance_tiles[(B * H, n_blocks)](
        q, k, lse, validf, tiles, H, H // k.shape[1], T, n_blocks,
        *q.stride(), *k.stride(), *lse.stride(), *validf.stride(), scale * LOG2E,
        BLOCK=BL, HEAD_DIM=dh, D_PAD=triton.next_power_of_2(dh),
        DOT_F32=q.device.type == "cpu" and q.dtype == torch.bfloat16, num_warps=4)
    # tile D's entry (i, j) is at m - n = D * BL + i - j; diagonal_sums_from gives, per tile, the sums at
    # c = i - j + BL - 1, i.e. at profile index D * BL + c + T - BL
    span = diagonal_sums_from(tiles.sum(0).view(H * n_blocks, BL, BL)).view(H, n_blocks, 2 * BL - 1)
    flat = span.new_zeros(H, (n_blocks + 1) * BL)  # position D * BL + c
    flat[:, : n_blocks * BL] += span[..., :BL].reshape(H, -1)
    flat[:, BL:] += torch.nn.functional.pad(span[..., BL:], (0, 1)).reshape(H, -1)
    out = span.new_zeros(H, 2 * T - 1)
    start = max(0, T - BL)  # profile index of flat's position max(0, BL - T)
    out[:, start:] = flat[:, start + BL - T : start + BL - T + 2 * T - 1 - start]
    return out



def interpreted() -> bool:
    """Whether Triton was imported in interpreter mode (``TRITON_INTERPRET=1``: kernels run on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def layer_profile(lq, lse: torch.Tensor) -> torch.Tensor:
    """The ``distance`` product of one layer (:mod:`~actlake.analysis.attention_weights`) from the kernel,
    with ``lse`` (B, H, >= T) of a FlashAttention forward call on the same q and k. The first call on
    each device in a process also computes it from explicit weights and raises if the two disagree (one
    host synchronisation, once)."""
    q, k, _ = lq.native
    T = q.shape[2]
    out = distance_profile(q, k, lse[..., :T], lq.batch.validf, lq.scaling)
    if q.device not in _verified:
        ref = explicit_products(lq, {"distance"}, max_elements=lq.max_elements)["distance"]
        err = float((out - ref).abs().max() / ref.abs().max().clamp(min=1e-30))
        if not err <= AGREEMENT:
            raise AnalysisError(
                f"attention layer {lq.layer}: the Triton distance kernel disagrees with explicit attention weights on "
                f"{q.device} (largest difference {err:.2e} of the largest value); set analyses.distance_kernel: blocks "
                "and report this with your GPU, torch and triton versions")
        _verified.add(q.device)
    return out
