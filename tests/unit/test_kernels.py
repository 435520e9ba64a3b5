"""The Triton kernels of analysis/engine/kernels.py against the explicit weights' products and the PyTorch moments, compiled on
CUDA tensors where there is a GPU, else through Triton's interpreter on CPU tensors (conftest.py sets
TRITON_INTERPRET=1 there): causal windows with right padding, grouped-query heads, head
sizes that are not powers of two, windows shorter than one tile and not a whole number of tiles, and
the 16-bit dtypes the kernels see on a GPU."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from actlake.analysis.engine.attention_weights import explicit_products, triton_kernels_on  # noqa: E402
from actlake.analysis.engine.heads import expand_kv  # noqa: E402
from actlake.analysis.engine.layer_qk import BatchInfo, LayerQK  # noqa: E402
from actlake.categories import one_hot  # noqa: E402
from actlake.errors import AnalysisError, ConfigError  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CASES = [
    (3, 4, 4, 37, 32, torch.bfloat16),   # padding, T < one 64-token tile
    (2, 4, 2, 70, 24, torch.float16),    # grouped-query heads, d_h not a power of two, 2 tiles
    (2, 2, 1, 128, 16, torch.bfloat16),  # T a whole number of tiles
    (2, 2, 2, 5, 16, torch.float32),     # shorter than the smallest tile
    (1, 1, 1, 1, 16, torch.bfloat16),    # one token
    (2, 2, 2, 19, 8, torch.float16),     # heads narrower than tl.dot's 16 (tiny test models)
    (1, 2, 1, 70, 160, torch.bfloat16),  # heads over 128 dimensions: 32-token tiles
]


def _layer(B, H, H_kv, T, dh, dtype, seed=0):
    """(LayerQK with 16-bit ``native`` q and k, log-sum-exp (B, H, T) as the flash forward returns it)."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, H, T, dh, generator=g) * 1.5).to(DEVICE, dtype)
    k = (torch.randn(B, H_kv, T, dh, generator=g) * 1.5).to(DEVICE, dtype)
    lengths = [T] + [max(1, T - 3 * i - 1) for i in range(1, B)]
    valid = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    onehot = one_hot(torch.zeros(B, T, dtype=torch.long), 5, valid)
    valid, onehot = valid.to(DEVICE), onehot.to(DEVICE)
    scale = dh ** -0.5
    lq = LayerQK(0, q.float(), k.float(), scale, BatchInfo(valid, True, onehot, onehot), native=(q, k, None))
    logits = (q.double() @ expand_kv(k, H).double().transpose(-1, -2)) * scale
    logits = logits.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=DEVICE).tril(), float("-inf"))
    return lq, torch.logsumexp(logits, -1).float()


@pytest.mark.parametrize("B,H,H_kv,T,dh,dtype", CASES)
def test_distance_kernel_equals_the_explicit_weights_profile(B, H, H_kv, T, dh, dtype):
    from actlake.analysis.engine.kernels import distance_profile

    lq, lse = _layer(B, H, H_kv, T, dh, dtype)
    want = explicit_products(lq, {"distance"})["distance"]
    got = distance_profile(lq.native[0], lq.native[1], lse, lq.batch.validf, lq.scaling)
    assert got.dtype == torch.float64 and got.shape == (H, 2 * T - 1)
    tol = 1e-5 if DEVICE.type == "cpu" else 1e-4  # the GPU's exp2 is approximate (2 ulp)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    # the identity behind the table: every valid query's weights sum to 1
    torch.testing.assert_close(got.sum(1), lq.batch.validf.sum().double().expand(H), rtol=tol, atol=tol)


@pytest.mark.parametrize("B,H,H_kv,T,dh,dtype", CASES)
def test_weighted_qsum_kernel_equals_the_explicit_weights_sums(B, H, H_kv, T, dh, dtype):
    """sum_m alpha_mn q_m at each key, over valid queries. On a GPU the kernel rounds alpha to the
    model's dtype before the product (as FlashAttention's backward pass does): bfloat16's 2^-9, float16's
    2^-11 relative per weight; on CPU tensors bfloat16 is multiplied in float32."""
    from actlake.analysis.engine.kernels import weighted_qsum

    lq, lse = _layer(B, H, H_kv, T, dh, dtype, seed=1)
    want = explicit_products(lq, {"weighted_qsum"})["weighted_qsum"]
    got = weighted_qsum(lq.native[0], lq.native[1], lse, lq.batch.validf, lq.scaling)
    assert got.dtype == torch.float32 and got.shape == (B, H, T, dh)
    tol = {torch.float16: 2e-3, torch.bfloat16: 1e-5 if DEVICE.type == "cpu" else 8e-3}.get(dtype, 1e-4)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())
    # identity: summed over keys, the weighted sums give the sum of the valid queries (each row of alpha sums to 1)
    torch.testing.assert_close(got.sum(2).double(), (lq.query * lq.batch.validf[:, None, :, None]).sum(2).double(),
                               rtol=tol, atol=tol * want.abs().max().item())


def test_layer_products_refuse_kernels_that_disagree_with_the_weights():
    """The first layer a process runs on a device is compared with explicit weights: a log-sum-exp in the
    wrong units (log2 instead of natural log) stops the run, naming the setting that avoids the kernels."""
    from actlake.analysis.engine import kernels

    lq, lse = _layer(2, 2, 2, 20, 16, torch.bfloat16)
    dev = ("attention", lq.native[0].device)  # cuda:0 where DEVICE says cuda
    kernels._verified.discard(dev)
    with pytest.raises(AnalysisError, match="triton_kernels: false"):
        kernels.layer_products(lq, {"distance", "weighted_qsum"}, lse * 1.4426950408889634)
    assert dev not in kernels._verified
    longer = torch.cat([lse, lse[..., :3]], -1)  # kernels that pad the log-sum-exp's last axis
    got = kernels.layer_products(lq, {"distance", "weighted_qsum"}, longer)
    assert dev in kernels._verified
    want = explicit_products(lq, {"distance", "weighted_qsum"})
    for name in want:
        tol = 1e-5 if DEVICE.type == "cpu" else 1e-2 * want[name].abs().max().item()
        torch.testing.assert_close(got[name], want[name], rtol=tol, atol=tol)


def test_a_kernel_that_fails_to_run_names_the_setting_that_avoids_it():
    from actlake.analysis.engine.kernels import _distance_tiles, _run

    with pytest.raises(AnalysisError, match=r"Triton kernel .* failed on .*analyses.triton_kernels: false"):
        _run(_distance_tiles, (1, 1), DEVICE, torch.zeros(1, device=DEVICE))  # arguments missing


def test_the_kernels_serve_cuda_workers_only():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert not triton_kernels_on(None, cpu) and not triton_kernels_on(False, cpu)
    assert triton_kernels_on(None, cuda) and triton_kernels_on(True, cuda)  # triton is installed here
    assert not triton_kernels_on(False, cuda)
    with pytest.raises(ConfigError, match="analyses.triton_kernels: true needs a CUDA device; this worker has cpu"):
        triton_kernels_on(True, cpu)


BIDIRECTIONAL = [  # (lengths of the windows, heads, head size, dtype); T = the longest
    ([37, 30, 1], 12, 64, torch.bfloat16),  # BERT-base's heads; a window of one token; T < one tile
    ([70, 64, 3], 12, 32, torch.float16),   # MiniLM's heads; two tiles, the second partly padding
    ([128, 0, 100], 4, 32, torch.bfloat16),  # a row of padding only (no valid token); whole tiles
    ([5, 2], 2, 16, torch.float32),          # shorter than the smallest tile
    ([19, 19], 2, 8, torch.float16),         # heads narrower than tl.dot's 16 (tiny test models)
]


def _encoder_layer(lengths, H, dh, dtype, seed=3):
    """A bidirectional layer over right-padded windows (LayerQK with 16-bit ``native`` q and k), five random
    key categories, and its float64 brute force: every product of METHODS.md §2-4 from the weights."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    q = (torch.randn(B, H, T, dh, generator=g) * 1.5).to(DEVICE, dtype)
    k = (torch.randn(B, H, T, dh, generator=g) * 1.5 + 0.5 * torch.randn(B, H, T, 1, generator=g)).to(DEVICE, dtype)
    valid = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    onehot = one_hot(torch.randint(0, 5, (B, T), generator=g), 5, valid)
    scale = dh ** -0.5
    lq = LayerQK(0, q.float(), k.float(), scale, BatchInfo(valid.to(DEVICE), False, onehot.to(DEVICE), onehot.to(DEVICE)),
                 native=(q, k, None), method="padded", triton=True)
    qd, kd, v = q.double().cpu(), k.double().cpu(), valid.bool()
    pair = v[:, None, None, :] & v[:, None, :, None]  # (B, 1, T, T) valid query and valid key

    def weights(keys):
        logits = (qd @ keys.transpose(-1, -2) * scale).masked_fill(~pair, float("-inf"))
        return torch.nan_to_num(torch.softmax(logits, -1))  # rows without a valid key: zero

    alpha = weights(kd)
    norms = kd.norm(dim=-1)  # (B, H, T)
    mean = (norms * v[:, None]).sum(-1, keepdim=True) / v.sum(-1).clamp(min=1)[:, None, None]
    alpha_kn = weights(kd * torch.where(norms > 0, mean / norms, 1.0)[..., None])
    cats = onehot.double()
    m_minus_n = torch.arange(T)[:, None] - torch.arange(T)[None, :] + T - 1
    distance = torch.zeros(H, 2 * T - 1, dtype=torch.float64).index_add_(
        1, m_minus_n.reshape(-1), alpha.sum(0).reshape(H, -1))
    want = {"mass": alpha @ cats[:, None], "mass_keynorm": alpha_kn @ cats[:, None],
            "weighted_qsum": alpha.transpose(-1, -2) @ (qd * v[:, None, :, None]), "distance": distance}
    return lq, want


@pytest.mark.parametrize("lengths,H,dh,dtype", BIDIRECTIONAL)
def test_bidirectional_kernels_equal_the_float64_brute_force(lengths, H, dh, dtype):
    """The encoder route (``padded_products``): masses by key category, key-normalised masses, weighted query
    sums and the distance profile, against float64 weights of the same 16-bit q and k."""
    from actlake.analysis.engine import kernels

    lq, want = _encoder_layer(lengths, H, dh, dtype)
    kernels._verified.discard(("bidirectional attention", DEVICE))
    got = {name: lq.product(name) for name in ("mass", "mass_keynorm", "weighted_qsum", "distance")}
    assert ("bidirectional attention", DEVICE) in kernels._verified  # checked against explicit weights once
    half = {torch.float16: 2e-3, torch.bfloat16: 1e-5 if DEVICE.type == "cpu" else 8e-3}.get(dtype, 1e-5)
    for name, value in got.items():
        ref = want[name]
        assert value.shape == ref.shape, name
        tol = (half if name in ("mass", "mass_keynorm", "weighted_qsum") else 1e-5) if DEVICE.type == "cpu" else 1e-2
        torch.testing.assert_close(value.double().cpu(), ref, rtol=tol, atol=tol * max(ref.abs().max().item(), 1.0),
                                   msg=name)
    # identities: a valid query's masses sum to 1 (0 without a valid key), and so do its weights over distances
    n_valid = torch.tensor(lengths, dtype=torch.float64)
    sums = got["mass"].double().cpu().sum(-1)  # (B, H, T)
    expect = (torch.arange(max(lengths))[None] < n_valid[:, None]).double()[:, None].expand_as(sums)
    torch.testing.assert_close(sums, expect, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(got["distance"].cpu().sum(1), n_valid.sum().expand(H), rtol=1e-3, atol=1e-3)


def _hidden(L1=3, B=3, T=50, d=70, dtype=torch.bfloat16, seed=2):
    """Hidden states (outlier dimensions included) with padding, role and type8 ids, as add_hidden sees them."""
    g = torch.Generator().manual_seed(seed)
    hs = [(torch.randn(B, T, d, generator=g) + torch.linspace(-40, 60, d)).to(DEVICE, dtype) for _ in range(L1)]
    valid = torch.ones(B, T, dtype=torch.long)
    valid[1, 31:] = 0
    valid[2, 5:] = 0
    return hs, valid, torch.randint(0, 4, (B, T), generator=g), torch.randint(0, 8, (B, T), generator=g)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_group_moments_kernel_equals_the_float64_products(dtype):
    """Sums, sums of squares and maxima per group: 150 rows (not a whole number of 128-row tiles), 70
    dimensions (not of 64), rows in no group, three partitions."""
    from actlake.analysis.dim_moments import GROUPS, group_ids
    from actlake.analysis.engine.kernels import group_moments
    from actlake.analysis.engine.moments import GroupSums

    hs, valid, role, type8 = _hidden(dtype=dtype)
    ids = group_ids(valid, role, type8).reshape(-1, 3)
    x = hs[0].reshape(-1, hs[0].shape[-1])
    got = group_moments(x, ids.to(DEVICE), len(GROUPS))
    work = GroupSums(ids, len(GROUPS), x.shape[1], device=DEVICE, segmented=False)
    _, sums, sq = work.sums(x.double())
    torch.testing.assert_close(got[0], sums, rtol=1e-12, atol=1e-9)
    torch.testing.assert_close(got[1], sq, rtol=1e-12, atol=1e-9)
    assert torch.equal(got[2], work.max_abs(x.double()))  # maxima are exact


def test_dim_moments_from_the_kernel_equal_the_strict_path():
    """DimMoments of a batch through the kernel (non-strict, as on a GPU) against the strict PyTorch path;
    the unchecked sum turns non-finite when a valid token holds an inf, not when a padded one does."""
    from actlake.analysis.engine import kernels
    from tests.conftest import dim_moments_of

    hs, valid, role, type8 = _hidden()
    kernels._verified.discard(("moments", hs[0].device))
    want = dim_moments_of(hs, valid, role, type8, exact_nonfinite=True)
    got = dim_moments_of(hs, valid, role, type8, exact_nonfinite=False, kernel=True)
    for f in ("count", "mean", "m2", "max_abs"):
        torch.testing.assert_close(getattr(got.moments, f), getattr(want.moments, f), rtol=1e-10, atol=1e-8)
    assert bool(torch.isfinite(got.unchecked)) and not got.problems()[0].any()
    assert ("moments", hs[0].device) in kernels._verified  # the first batch was checked against PyTorch
    kernels._verified.discard(("moments", hs[0].device))
    hs[-1][0, 7, 3] = float("inf")  # an inf in the compared layer: no comparison, no error; the strict rerun tells
    assert dim_moments_of(hs, valid, role, type8, False, kernel=True).problems()[0].any()
    assert ("moments", hs[0].device) not in kernels._verified
    hs[-1][0, 7, 3] = 0.0
    hs[1][2, 40, 3] = float("inf")  # padding: counts for no statistic
    assert bool(torch.isfinite(dim_moments_of(hs, valid, role, type8, False, kernel=True).unchecked))
    hs[1][0, 7, 3] = float("inf")
    assert dim_moments_of(hs, valid, role, type8, False, kernel=True).problems()[0].any()


COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from actlake.analysis.engine import kernels

CASES = [
    ("_distance_tiles", "bf16", dict(BLOCK=64, HEAD_DIM=64, D_PAD=64, DOT_F32=False, CAUSAL=True)),
    ("_distance_tiles", "fp16", dict(BLOCK=32, HEAD_DIM=160, D_PAD=256, DOT_F32=False, CAUSAL=True)),
    ("_weighted_qsum_rows", "bf16", dict(BLOCK=64, HEAD_DIM=80, D_PAD=128, DOT_F32=False, CAUSAL=True)),
    ("_weighted_qsum_rows", "fp16", dict(BLOCK=32, HEAD_DIM=256, D_PAD=256, DOT_F32=False, CAUSAL=True)),
    # the bidirectional route (encoders): MiniLM's and BERT's head sizes
    ("_distance_tiles", "bf16", dict(BLOCK=64, HEAD_DIM=32, D_PAD=32, DOT_F32=False, CAUSAL=False)),
    ("_weighted_qsum_rows", "bf16", dict(BLOCK=64, HEAD_DIM=64, D_PAD=64, DOT_F32=False, CAUSAL=False)),
    ("_category_mass_rows", "bf16", dict(BLOCK=64, HEAD_DIM=32, D_PAD=32, C_PAD=16, DOT_F32=False, CAUSAL=False,
                                         SCALED=False)),
    ("_category_mass_rows", "fp16", dict(BLOCK=64, HEAD_DIM=64, D_PAD=64, C_PAD=16, DOT_F32=False, CAUSAL=False,
                                         SCALED=True)),
    ("_group_moments_tiles", "bf16", dict(S=4, BR=64, BD=64)),
    ("_group_moments_tiles", "fp32", dict(S=4, BR=64, BD=64)),
]
for kernel, dtype, consts in CASES:
    fn = getattr(kernels, kernel)
    pointers = {"q_ptr": dtype, "k_ptr": dtype, "x_ptr": dtype, "lse_ptr": "fp32", "valid_ptr": "fp32",
                "ks_ptr": "fp32", "cat_ptr": "fp32",
                "ids_ptr": "i32", "out_ptr": "fp64" if kernel == "_group_moments_tiles" else "fp32"}
    signature = {a: "constexpr" if a in consts else ("*" + pointers[a] if a in pointers else
                 "fp32" if a == "scale_log2e" else "i32") for a in fn.arg_names}
    compiled = triton.compile(ASTSource(fn, signature, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4})
    assert compiled.asm["cubin"], kernel
    print("compiled", kernel, dtype, consts)
"""


def test_kernels_compile_for_an_h100():
    """Ahead-of-time compilation to H100 machine code (sm_90, through the ptxas in triton's wheel), in a
    process without the interpreter: the interpreter accepts constructs the GPU compiler does not, and CI
    has no GPU. Only compilation: no kernel runs."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    run = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("compiled") == 10
