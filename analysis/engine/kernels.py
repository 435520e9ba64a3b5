"""Triton kernels for what PyTorch operators give only at many times the memory traffic on a GPU.

Attention (the FlashAttention path: causal, right padding, 16-bit): two products of the weights that
FlashAttention does not give cheaply. Both rebuild the weights tile by tile from q, k and the softmax's
log-sum-exp per query, which the FlashAttention forward call made anyway (for the output or the mass)
returns: alpha = exp(scale q.k - lse), on tensor cores in the model's dtype, like the kernel that
computed the layer's output. No T x T matrix is ever in memory, and tiles above the causal diagonal
are skipped.

- :func:`distance_profile` (METHODS.md §4): for every head and distance m - n, the summed weight. Grouping
  by m - n inside a tile has no matrix form, so the kernel does not group: one program per (sequence,
  head, block diagonal D) walks the tiles (query block I, key block I - D), whose entry (i, j) always
  lies at distance D * BLOCK + i - j, and adds them up elementwise in registers (no atomics, no scratch
  memory). Out comes one BLOCK x BLOCK tile per (sequence, head, D), B * H * T * BLOCK floats
  (Pythia-410m, 16 windows of 1,024 tokens: 64 MB), which PyTorch sums over the sequences and then
  along its diagonals. Cost: half a causal QK^T product.
- :func:`weighted_qsum` (METHODS.md §3): at each key n, sum_m alpha_mn q_m over valid queries. One program
  per (sequence, head, key block) walks the query blocks at or after it: two products per tile (QK^T and
  alpha^T Q), where FlashAttention's backward pass, which gave it as dV, makes five (it also computes dQ
  and dK, which nothing reads).

Residual stream (:func:`group_moments`): per group of tokens and dimension, the sum, the sum of squares
and the largest |x| of one layer's hidden states, read once in the model's dtype and summed in float64,
where the PyTorch path writes and reads [x | x^2] in float64 (16 bytes per value, where a bfloat16 x has 2)
for a product with the membership matrix.

CPU tests run the same kernels through Triton's interpreter (``TRITON_INTERPRET=1`` before triton is
imported), on small shapes, against the PyTorch way. In a job, the first use of each kernel on a device
is also compared with the PyTorch way (:func:`layer_products`, ``BatchMoments._verify``;
:func:`check_agreement`).
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

from actlake.analysis.engine.attention_weights import diagonal_sums_from, explicit_products, key_norm_scale
from actlake.errors import AnalysisError

LOG2E = 1.4426950408889634
AGREEMENT = 1e-2
"""Largest |kernel - PyTorch| / largest |value| allowed at the first use of a kernel on a device in a
process; 16-bit inputs put the attention products about 1e-3 apart at most (the moments, float64 both
ways, 1e-15), a wrong log-sum-exp convention or a miscompiled kernel far more."""
_verified: set = set()  # (kernel, device) pairs that matched the PyTorch path in this process


@triton.jit
def _rows(ptr, base, pos, s_t, s_d, T, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    """(len(pos), D_PAD) rows at positions ``pos`` of one head, zero beyond T and beyond HEAD_DIM."""
    c = tl.arange(0, D_PAD)
    return tl.load(ptr + base + pos[:, None] * s_t + c[None, :] * s_d,
                   mask=(pos[:, None] < T) & (c[None, :] < HEAD_DIM), other=0.0)


@triton.jit
def _weights_t(q, k, lse, valid, kvalid, m, n, scale_log2e, CAUSAL: tl.constexpr, DOT_F32: tl.constexpr):
    """(BLOCK keys, BLOCK queries) float32 weights of queries m (rows q, their lse and validity) on keys n
    (rows k, their validity), transposed: computed as k q^T, already in the layout of the accumulator of a
    product alpha^T Q (no conversion through shared memory). Zero where the query or the key is not valid,
    and with ``CAUSAL`` where n > m. ``DOT_F32``: multiply in full float32 (the interpreter's bfloat16
    products are wrong, and products of bfloat16 numbers are exact in float32; float32 inputs, which only
    tests give, would otherwise be rounded to TF32)."""
    if DOT_F32:
        s = tl.dot(k.to(tl.float32), tl.trans(q.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(k, tl.trans(q))  # 16-bit inputs, float32 accumulation
    p = tl.exp2(s * scale_log2e - lse[None, :] * 1.4426950408889634)
    keep = (valid[None, :] > 0) & (kvalid[:, None] > 0)
    if CAUSAL:
        keep = keep & (m[None, :] >= n[:, None])
    return tl.where(keep, p, 0.0)


@triton.jit
def _distance_tiles(q_ptr, k_ptr, lse_ptr, valid_ptr, out_ptr, n_heads, kv_group, T, n_blocks,
                    sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d, sl_b, sl_h, sl_t, sv_b, sv_t, scale_log2e,
                    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, DOT_F32: tl.constexpr,
                    CAUSAL: tl.constexpr):
    """Program (b * H + h, P): out[b, h, P] = sum over the query blocks I of the weights' tile of keys
    (I - D) * BLOCK + j and queries I * BLOCK + i (transposed: rows are keys), where the block diagonal D is
    P (causal: D >= 0) or P - (n_blocks - 1) (bidirectional: keys after the query too)."""
    bh = tl.program_id(0).to(tl.int64)  # offsets in 64 bits: large batches pass 2^31 elements
    P = tl.program_id(1)
    if CAUSAL:
        D = P
    else:
        D = P - (n_blocks - 1)
    b, h = bh // n_heads, bh % n_heads
    i = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for I in range(tl.maximum(D, 0), tl.minimum(n_blocks, n_blocks + D)):  # key block I - D in [0, n_blocks)
        m, n = I * BLOCK + i, (I - D) * BLOCK + i  # (BLOCK,) query and key positions
        q = _rows(q_ptr, b * sq_b + h * sq_h, m, sq_t, sq_d, T, HEAD_DIM, D_PAD)  # (BLOCK, D_PAD)
        k = _rows(k_ptr, b * sk_b + (h // kv_group) * sk_h, n, sk_t, sk_d, T, HEAD_DIM, D_PAD)
        lse = tl.load(lse_ptr + b * sl_b + h * sl_h + m * sl_t, mask=m < T, other=0.0)  # (BLOCK,)
        valid = tl.load(valid_ptr + b * sv_b + m * sv_t, mask=m < T, other=0.0)
        kvalid = tl.load(valid_ptr + b * sv_b + n * sv_t, mask=n < T, other=0.0)
        acc += _weights_t(q, k, lse, valid, kvalid, m, n, scale_log2e, CAUSAL, DOT_F32)
    tl.store(out_ptr + ((bh * tl.num_programs(1) + P) * BLOCK + i[:, None]) * BLOCK + i[None, :], acc)


@triton.jit
def _weighted_qsum_rows(q_ptr, k_ptr, lse_ptr, valid_ptr, out_ptr, n_heads, kv_group, T, n_blocks,
                        sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d, sl_b, sl_h, sl_t, sv_b, sv_t, scale_log2e,
                        BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, DOT_F32: tl.constexpr,
                        CAUSAL: tl.constexpr):
    """Program (b * H + h, J): out[b, h, n] = sum over valid queries m (causal: m >= n) of alpha_mn q_m, for
    the keys n of block J (out: (B, H, T, HEAD_DIM) float32, contiguous)."""
    bh = tl.program_id(0).to(tl.int64)
    J = tl.program_id(1)
    b, h = bh // n_heads, bh % n_heads
    i = tl.arange(0, BLOCK)
    n = J * BLOCK + i
    k = _rows(k_ptr, b * sk_b + (h // kv_group) * sk_h, n, sk_t, sk_d, T, HEAD_DIM, D_PAD)  # (BLOCK, D_PAD)
    kvalid = tl.load(valid_ptr + b * sv_b + n * sv_t, mask=n < T, other=0.0)
    acc = tl.zeros((BLOCK, D_PAD), dtype=tl.float32)
    first = 0
    if CAUSAL:
        first = J
    for I in range(first, n_blocks):
        m = I * BLOCK + i
        q = _rows(q_ptr, b * sq_b + h * sq_h, m, sq_t, sq_d, T, HEAD_DIM, D_PAD)
        lse = tl.load(lse_ptr + b * sl_b + h * sl_h + m * sl_t, mask=m < T, other=0.0)
        valid = tl.load(valid_ptr + b * sv_b + m * sv_t, mask=m < T, other=0.0)
        pt = _weights_t(q, k, lse, valid, kvalid, m, n, scale_log2e, CAUSAL, DOT_F32)  # (BLOCK keys, BLOCK queries)
        if DOT_F32:
            acc += tl.dot(pt, q.to(tl.float32), input_precision="ieee")
        else:  # alpha rounded to the model's dtype, as FlashAttention's backward pass rounds it for dV
            acc += tl.dot(pt.to(q.dtype), q)
    c = tl.arange(0, D_PAD)
    tl.store(out_ptr + ((bh * T + n[:, None]) * HEAD_DIM + c[None, :]), acc,
             mask=(n[:, None] < T) & (c[None, :] < HEAD_DIM))


@triton.jit
def _category_mass_rows(q_ptr, k_ptr, ks_ptr, cat_ptr, valid_ptr, out_ptr, lse_ptr, n_heads, kv_group, T, n_blocks,
                        sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d, ss_b, ss_h, ss_t, sc_b, sc_t, sc_c,
                        sv_b, sv_t, scale_log2e, C,
                        BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, C_PAD: tl.constexpr,
                        DOT_F32: tl.constexpr, CAUSAL: tl.constexpr, SCALED: tl.constexpr):
    """Program (b * H + h, I): for the queries m of block I, out[b, h, m, c] = sum over valid keys n (causal:
    n <= m) of alpha_mn [category of n is c], by an online softmax over the key blocks (FlashAttention's
    forward pass with V the one-hot key categories); with ``SCALED`` each key's logits are multiplied by
    ks[b, h, n] (keys rescaled to their mean norm), else lse[b, h, m] gets the rows' log-sum-exp (natural
    log), which the other kernels rebuild the weights from. Rows of invalid queries, or without a valid
    key, are zero (out: (B, H, T, C) float32, contiguous)."""
    bh = tl.program_id(0).to(tl.int64)
    I = tl.program_id(1)
    b, h = bh // n_heads, bh % n_heads
    i = tl.arange(0, BLOCK)
    m = I * BLOCK + i
    c = tl.arange(0, C_PAD)
    q = _rows(q_ptr, b * sq_b + h * sq_h, m, sq_t, sq_d, T, HEAD_DIM, D_PAD)  # (BLOCK, D_PAD)
    top = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)  # running max of the base-2 logits
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    acc = tl.zeros((BLOCK, C_PAD), dtype=tl.float32)
    last = n_blocks
    if CAUSAL:
        last = I + 1
    for J in range(0, last):
        n = J * BLOCK + i
        k = _rows(k_ptr, b * sk_b + (h // kv_group) * sk_h, n, sk_t, sk_d, T, HEAD_DIM, D_PAD)
        kvalid = tl.load(valid_ptr + b * sv_b + n * sv_t, mask=n < T, other=0.0)
        if DOT_F32:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))  # (BLOCK queries, BLOCK keys)
        s = s * scale_log2e
        if SCALED:
            s = s * tl.load(ks_ptr + b * ss_b + h * ss_h + n * ss_t, mask=n < T, other=1.0)[None, :]
        keep = kvalid[None, :] > 0
        if CAUSAL:
            keep = keep & (m[:, None] >= n[None, :])
        s = tl.where(keep, s, float("-inf"))
        new_top = tl.maximum(top, tl.max(s, 1))
        safe = tl.where(new_top == float("-inf"), 0.0, new_top)  # no valid key yet: nothing to rescale
        p = tl.exp2(s - safe[:, None])
        rescale = tl.exp2(top - safe)
        cats = tl.load(cat_ptr + b * sc_b + n[:, None] * sc_t + c[None, :] * sc_c,
                       mask=(n[:, None] < T) & (c[None, :] < C), other=0.0)  # (BLOCK keys, C_PAD)
        if DOT_F32:
            acc = acc * rescale[:, None] + tl.dot(p, cats, input_precision="ieee")
        else:  # weights in float16 (2^-11), the categories 0 or 1: as the flash route's key-normalised mass
            acc = acc * rescale[:, None] + tl.dot(p.to(tl.float16), cats.to(tl.float16))
        total = total * rescale + tl.sum(p, 1)
        top = new_top
    valid = tl.load(valid_ptr + b * sv_b + m * sv_t, mask=m < T, other=0.0)
    ok = (valid > 0) & (total > 0)
    out = tl.where(ok[:, None], acc / tl.where(ok, total, 1.0)[:, None], 0.0)
    tl.store(out_ptr + ((bh * T + m[:, None]) * C + c[None, :]), out, mask=(m[:, None] < T) & (c[None, :] < C))
    if SCALED:
        pass
    else:
        lse = tl.where(ok, (top + tl.log2(tl.where(ok, total, 1.0))) * 0.6931471805599453, 0.0)
        tl.store(lse_ptr + bh * T + m, lse, mask=m < T)


def block_size(T: int, head_dim: int = 64) -> int:
    """Queries (and keys) per tile: 64 (32 for heads of more than 128 dimensions, which would spill
    registers), or less for short windows (at least 16, what tl.dot needs)."""
    return max(16, min(64 if head_dim <= 128 else 32, triton.next_power_of_2(T)))


def _run(kernel, grid, device: torch.device, *args, **meta) -> None:
    """Launch ``kernel`` on ``device`` (Triton launches on the current CUDA device, not on the tensors':
    layers split over GPUs would otherwise hand one GPU another's pointers). A kernel that fails to
    compile or launch is an AnalysisError naming the setting that avoids it."""
    try:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            kernel[grid](*args, **meta)
    except Exception as e:  # noqa: BLE001 - Triton raises compilation, resource and driver errors of many types
        name = getattr(kernel, "__name__", "kernel")
        raise AnalysisError(f"the Triton kernel {name} failed on {device} ({type(e).__name__}: {str(e)[:300]}); "
                            "set analyses.triton_kernels: false") from e


def _launch(kernel, out, q, k, lse, validf, scale, causal: bool = True, programs: int | None = None) -> None:
    """Run ``kernel`` on (B * H, ``programs`` or the blocks of T) programs. q (B, H, T, d_h), k (B, H_kv, T,
    d_h) 16-bit on a GPU; lse (B, H, T) float32; validf (B, T) 1.0 for valid tokens."""
    _check_device(q)
    B, H, T, dh = q.shape
    BL = block_size(T, dh)
    _run(kernel, (B * H, programs or -(-T // BL)), q.device,
        q, k, lse, validf, out, H, H // k.shape[1], T, -(-T // BL),
        *q.stride(), *k.stride(), *lse.stride(), *validf.stride(), scale * LOG2E,
        BLOCK=BL, HEAD_DIM=dh, D_PAD=_d_pad(dh), DOT_F32=_dot_f32(q), CAUSAL=causal, num_warps=4)


def _check_device(q: torch.Tensor) -> None:
    if q.device.type != "cuda" and not interpreted():
        raise ValueError("the Triton attention kernels run on CUDA tensors, or on CPU tensors under "
                         "TRITON_INTERPRET=1 (tests)")


def _d_pad(dh: int) -> int:
    return max(16, triton.next_power_of_2(dh))  # tl.dot wants 16 or more


def _dot_f32(q: torch.Tensor) -> bool:
    return q.dtype == torch.float32 or (q.device.type == "cpu" and q.dtype == torch.bfloat16)


def distance_profile(q, k, lse, validf, scale: float, causal: bool = True) -> torch.Tensor:
    """(H, 2T - 1) float64: summed attention weight at each m - n (index m - n + T - 1) over the batch's
    valid queries; causal: zero at negative distances. Arguments as :func:`_launch`; right padding is
    assumed (valid queries see only valid keys)."""
    B, H, T, dh = q.shape
    BL = block_size(T, dh)
    n_blocks = -(-T // BL)
    n_diag = n_blocks if causal else 2 * n_blocks - 1
    tiles = torch.empty(B, H, n_diag, BL, BL, dtype=torch.float32, device=q.device)
    _launch(_distance_tiles, tiles, q, k, lse, validf, scale, causal, n_diag)
    # tile P's entry (i, j) (query i, key j once transposed) is at m - n = D * BL + i - j, D = P + first its block
    # diagonal; diagonal_sums_from gives, per tile, the sums at c = i - j + BL - 1, which lie at position
    # f = P * BL + c of ``flat`` (the tiles' two halves overlap by a block) and at profile index f + off
    by_query = tiles.sum(0).transpose(-1, -2).reshape(H * n_diag, BL, BL)
    span = diagonal_sums_from(by_query).view(H, n_diag, 2 * BL - 1)
    flat = span.new_zeros(H, (n_diag + 1) * BL)
    flat[:, : n_diag * BL] += span[..., :BL].reshape(H, -1)
    flat[:, BL:] += torch.nn.functional.pad(span[..., BL:], (0, 1)).reshape(H, -1)
    first = 0 if causal else -(n_blocks - 1)
    off = first * BL + T - BL  # slices with host integers: no read-back (a layer graph may be recording)
    out = span.new_zeros(H, 2 * T - 1)
    lo, hi = max(0, off), min(2 * T - 1, flat.shape[1] + off)  # profile indices the tiles cover
    out[:, lo:hi] = flat[:, lo - off : hi - off]
    return out


def weighted_qsum(q, k, lse, validf, scale: float, causal: bool = True) -> torch.Tensor:
    """(B, H, T, d_h) float32: at each key n, sum_m alpha_mn q_m over the valid queries m (causal: m >= n;
    METHODS.md §3, the ``weighted_qsum`` product). Arguments as :func:`_launch`."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    _launch(_weighted_qsum_rows, out, q, k, lse, validf, scale, causal)
    return out


def category_mass(q, k, categories, validf, scale: float, key_scale: torch.Tensor | None = None,
                  causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(mass (B, H, T, C) float32, log-sum-exp (B, H, T) float32 or None): for each valid query, the attention
    it gives to each key category (METHODS.md §2; ``categories`` (B, T, C) one-hot, zero on padding), with
    every key's logits multiplied by ``key_scale`` (B, H, T) when given (the key-normalised mass, METHODS.md
    §4; then no log-sum-exp). One pass over the key tiles with an online softmax: no T x T matrix, and no
    attention output is needed for it."""
    _check_device(q)
    B, H, T, dh = q.shape
    C = categories.shape[-1]
    BL = block_size(T, dh)
    out = torch.empty(B, H, T, C, dtype=torch.float32, device=q.device)
    lse = None if key_scale is not None else torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    cats = categories.float()
    ks = key_scale if key_scale is not None else validf[:, None]  # (B, 1, T): not read without SCALED
    _run(_category_mass_rows, (B * H, -(-T // BL)), q.device,
         q, k, ks, cats, validf, out, lse if lse is not None else out, H, H // k.shape[1], T, -(-T // BL),
         *q.stride(), *k.stride(), *ks.stride(), *cats.stride(),
         *validf.stride(), scale * LOG2E, C,
         BLOCK=BL, HEAD_DIM=dh, D_PAD=_d_pad(dh), C_PAD=max(16, triton.next_power_of_2(C)),
         DOT_F32=_dot_f32(q), CAUSAL=causal, SCALED=key_scale is not None, num_warps=4)
    return out, lse


def layer_products(lq, names, lse: torch.Tensor) -> dict:
    """``names`` (of :data:`~actlake.analysis.engine.attention_weights.TRITON`) of one causal layer from the
    kernels, with ``lse`` (B, H, >= T) of a FlashAttention forward call on the same q and k. The first call on
    each device in a process also computes them from explicit weights and raises if the two disagree
    (:func:`_checked_once`)."""
    q, k, _ = lq.native
    T = q.shape[2]
    args = (q, k, lse[..., :T], lq.batch.validf, lq.scaling)
    out = {}
    if "distance" in names:
        out["distance"] = distance_profile(*args)
    if "weighted_qsum" in names:
        out["weighted_qsum"] = weighted_qsum(*args)
    return _checked_once(lq, out, "attention")


def padded_products(lq, names) -> dict:
    """``names`` (of :data:`~actlake.analysis.engine.attention_weights.PADDED`) of one bidirectional layer over
    right-padded windows (an encoder: BERT, MiniLM), from the kernels on the model's q and k (``lq.native``):
    the masses by key category first, whose pass gives the rows' log-sum-exp, then the weighted query sums and
    the distance profile rebuilt tile by tile from it. No T x T matrix and no float32 copy of q and k. The
    first call on each device in a process is checked against explicit weights (:func:`_checked_once`)."""
    q, k, _ = lq.native
    validf, cats, scale = lq.batch.validf, lq.key_onehot, float(lq.scaling)
    out, lse = {}, None
    if names & {"mass", "weighted_qsum", "distance"}:
        mass, lse = category_mass(q, k, cats, validf, scale)
        if "mass" in names:
            out["mass"] = mass
    if "mass_keynorm" in names:
        out["mass_keynorm"] = category_mass(q, k, cats, validf, scale, key_scale=key_norm_scale(lq))[0]
    if "weighted_qsum" in names:
        out["weighted_qsum"] = weighted_qsum(q, k, lse, validf, scale, causal=False)
    if "distance" in names:
        out["distance"] = distance_profile(q, k, lse, validf, scale, causal=False)
    return _checked_once(lq, out, "bidirectional attention")


def _checked_once(lq, out: dict, route: str) -> dict:
    """``out``, compared with explicit weights' products at the route's first use on the device in this process
    (one host synchronisation, once; skipped while an input holds inf/NaN, and while a layer graph records:
    ``analyses.layer_graphs``)."""
    device = lq.native[0].device
    if (route, device) not in _verified and out and not capturing(device):
        ref = explicit_products(lq, set(out), max_elements=lq.max_elements)
        if all([check_agreement(f"{route} layer {lq.layer}: {name}", value, ref[name]) for name, value in out.items()]):
            _verified.add((route, device))
    return out


def check_agreement(what: str, kernel: torch.Tensor, reference: torch.Tensor) -> bool:
    """Raise AnalysisError when a kernel's output is further than :data:`AGREEMENT` (relative to the largest
    |value|) from what PyTorch operators give for the same input (one host synchronisation). False, without
    comparing, when the reference is not finite: the input held inf/NaN, and the batch runs again strictly."""
    if not bool(torch.isfinite(reference).all()):
        return False
    err = float((kernel - reference).abs().max() / reference.abs().max().clamp(min=1e-30))
    if not err <= AGREEMENT:
        raise AnalysisError(
            f"{what}: the Triton kernel disagrees with PyTorch on {kernel.device} (largest difference {err:.2e} of "
            "the largest value); set analyses.triton_kernels: false and report this with your GPU, torch and triton "
            "versions")
    return True


def capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is being captured into a CUDA graph (which a read-back would break)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``: on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


@triton.jit
def _group_moments_tiles(x_ptr, ids_ptr, out_ptr, N, d, n_groups, sx_n, sx_d, si_n, si_s,
                         S: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    """Program (row tile r, column tile c): for each group g, the float64 sum, sum of squares and max |x|
    over the tile's rows in g (a row is in g when any of its S partition ids is g), written to
    out[0..2, r, g, columns] (out: (3, R, G, d) float64, contiguous)."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    rows = r * BR + tl.arange(0, BR)
    cols = c * BD + tl.arange(0, BD)
    inside = (rows[:, None] < N) & (cols[None, :] < d)
    x = tl.load(x_ptr + rows[:, None] * sx_n + cols[None, :] * sx_d, mask=inside, other=0.0).to(tl.float64)
    x2 = x * x
    ax = tl.abs(x)
    ids = tl.load(ids_ptr + rows[:, None] * si_n + tl.arange(0, S)[None, :] * si_s,
                  mask=rows[:, None] < N, other=n_groups)  # (BR, S); n_groups: no group
    plane = (tl.num_programs(0) * n_groups).to(tl.int64) * d  # elements per output (R * G * d)
    for g in range(n_groups):
        member = tl.max((ids == g).to(tl.int32), axis=1) > 0  # (BR,)
        at = out_ptr + (r * n_groups + g) * d + cols
        tl.store(at, tl.sum(tl.where(member[:, None], x, 0.0), axis=0), mask=cols < d)
        tl.store(at + plane, tl.sum(tl.where(member[:, None], x2, 0.0), axis=0), mask=cols < d)
        tl.store(at + 2 * plane, tl.max(tl.where(member[:, None], ax, 0.0), axis=0), mask=cols < d)


def group_moments(x: torch.Tensor, ids: torch.Tensor, n_groups: int, out: torch.Tensor | None = None,
                  rows: int = 64, cols: int = 64) -> torch.Tensor:
    """(3, G, d) float64: per group, the sum, the sum of squares and the largest |x| of ``x`` (N, d) (any
    float dtype), over the groups of ``ids`` (N, S) int (a row's group in each of S partitions;
    ``n_groups``: none). Empty groups give zeros. Float64 sums within tiles of ``rows`` rows, then over
    the tiles (deterministic: no atomics); maxima are exact. ``out``: a contiguous (3, G, d) float64
    tensor to write into."""
    if x.device.type != "cuda" and not interpreted():
        raise ValueError("the Triton kernels run on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (tests)")
    N, d = x.shape
    S = ids.shape[1]
    if S & (S - 1):  # tl.arange needs a power of two
        pad = triton.next_power_of_2(S) - S
        ids = torch.cat([ids, ids.new_full((N, pad), n_groups)], 1)
    R = max(1, -(-N // rows))
    tiles = torch.empty(3, R, n_groups, d, dtype=torch.float64, device=x.device)
    _run(_group_moments_tiles, (R, -(-d // cols)), x.device, x, ids, tiles, N, d, n_groups, *x.stride(),
         *ids.stride(), S=ids.shape[1], BR=rows, BD=cols, num_warps=4)
    out = torch.empty(3, n_groups, d, dtype=torch.float64, device=x.device) if out is None else out
    torch.sum(tiles[:2], 1, out=out[:2])
    torch.amax(tiles[2], 0, out=out[2])
    return out
