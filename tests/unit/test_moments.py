import numpy as np
import torch

from actlake.analysis.dim_moments import GROUPS, DimMoments
from actlake.analysis.engine.moments import GroupSums, Moments
from tests.conftest import dim_moments_of


def _random_batch(seed, B=3, T=7, d=5, L1=3):
    g = torch.Generator().manual_seed(seed)
    hs = [torch.randn(B, T, d, generator=g) * 3 + 1 for _ in range(L1)]
    valid = (torch.rand(B, T, generator=g) > 0.2).long()
    role = torch.randint(0, 5, (B, T), generator=g)
    type8 = torch.randint(0, 8, (B, T), generator=g)
    return hs, valid, role, type8


def _moments(x, ids, n_groups) -> Moments:
    """x: (N, d) values; ids: (N, S) the group of each value in each of S partitions of the groups (``n_groups``:
    none). Moments (G, d), as a batch's are built (GroupSums, then Moments.from_sums)."""
    work = GroupSums(ids, n_groups, x.shape[1])
    return Moments.from_sums(*work.sums(x), work.max_abs(x))


def test_moments_match_numpy_and_merge_halves():
    x = torch.randn(200, 6, dtype=torch.float64) * 5 + 2
    # two partitions: group 0 holds every value, group 1 every third (2: none)
    ids = torch.stack([torch.zeros(200, dtype=torch.long), torch.where(torch.arange(200) % 3 == 0, 1, 2)], 1)
    groups = torch.stack([torch.ones(200), (torch.arange(200) % 3 == 0).double()], 1)
    whole = _moments(x, ids, 2)
    a = _moments(x[:77], ids[:77], 2)
    b = _moments(x[77:], ids[77:], 2)
    for merged in (a.merge(b), b.merge(a)):
        np.testing.assert_allclose(merged.count, whole.count)
        np.testing.assert_allclose(merged.mean, whole.mean, rtol=1e-12)
        np.testing.assert_allclose(merged.m2, whole.m2, rtol=1e-10)
        np.testing.assert_array_equal(merged.max_abs, whole.max_abs)
    sel = x[groups[:, 1] > 0].numpy()
    np.testing.assert_allclose(whole.mean[1], sel.mean(0), rtol=1e-12)
    np.testing.assert_allclose(whole.variance[1], sel.var(0), rtol=1e-10)
    np.testing.assert_allclose(whole.max_abs[1], np.abs(sel).max(0))


def test_group_sums_in_row_blocks_equal_the_plain_sums():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1100, 9, generator=g) * 4 - 3
    ids = torch.stack([torch.where(torch.arange(1100) < 1050, 0, 4), torch.randint(1, 5, (1100,), generator=g)], 1)
    member = torch.nn.functional.one_hot(ids, 5)[..., :4].sum(1).double()  # (N, G)
    for rows in (1, 64, 512, 5000):  # partial last blocks, one block
        count, sums, sq = GroupSums(ids, 4, 9, rows=rows).sums(x)
        torch.testing.assert_close(count, member.sum(0))
        torch.testing.assert_close(sums, member.T @ x.double(), rtol=1e-12, atol=1e-9)
        torch.testing.assert_close(sq, member.T @ x.double() ** 2, rtol=1e-12, atol=1e-9)
    # grouped max by index_reduce (CPU); by chunks of each group's sorted rows (GPU), chunks shorter than,
    # not dividing, and longer than the groups
    for segmented, chunk in ((False, 256), (True, 1), (True, 7), (True, 256), (True, 4096)):
        top = GroupSums(ids, 4, 9, segmented=segmented, chunk=chunk).max_abs(x)  # group 0: one group over some rows
        for k in range(4):
            pick = member[:, k] > 0
            torch.testing.assert_close(top[k], x[pick].abs().amax(0) if pick.any() else torch.zeros(9), rtol=0, atol=0)


def test_dim_moments_halves_equal_whole_and_roundtrip_arrow():
    hs, valid, role, type8 = _random_batch(0, B=4)
    whole = dim_moments_of(hs, valid, role, type8)
    first = dim_moments_of([h[:2] for h in hs], valid[:2], role[:2], type8[:2])
    second = dim_moments_of([h[2:] for h in hs], valid[2:], role[2:], type8[2:])
    merged = second.merge(first)
    np.testing.assert_allclose(merged.moments.mean, whole.moments.mean, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(merged.moments.m2, whole.moments.m2, rtol=1e-10, atol=1e-10)
    back = DimMoments.from_arrow(whole.to_arrow())
    np.testing.assert_array_equal(back.moments.mean, whole.moments.mean)
    np.testing.assert_array_equal(back.moments.count, whole.moments.count)
    # the 'all' group counts every valid token
    assert whole.moments.count[0, GROUPS.index(("all", "all"))] == valid.sum()
    # every group of every scheme against its members, picked the plain way
    from actlake.categories import ROLE, TYPE8

    for layer, h in enumerate(hs):
        for g, (scheme, cat) in enumerate(GROUPS):
            pick = valid.bool()
            if scheme == "role":
                pick &= role == ROLE.index(cat)
            elif scheme == "type8":
                pick &= type8 == TYPE8.index(cat)
            sel = h[pick].double().numpy()
            assert whole.moments.count[layer, g] == len(sel)
            if len(sel):
                np.testing.assert_allclose(whole.moments.mean[layer, g], sel.mean(0), rtol=1e-10, atol=1e-12)
                np.testing.assert_allclose(whole.moments.m2[layer, g], sel.var(0) * len(sel), rtol=1e-8, atol=1e-10)
                np.testing.assert_array_equal(whole.moments.max_abs[layer, g], np.abs(sel).max(0))


def test_layers_of_different_dtypes_keep_their_values():
    """A float16 layer beside a float32 one whose values float16 cannot hold: each layer's moments are its
    own values (nothing is cast to the first layer's dtype)."""
    hs, valid, role, type8 = _random_batch(2)
    hs = [hs[0].half(), hs[1] * 1e5, hs[2]]  # |values| up to ~1e6: beyond float16's 65504
    mixed = dim_moments_of(hs, valid, role, type8)
    alone = dim_moments_of([h.float() for h in hs], valid, role, type8)
    assert bool(torch.isfinite(mixed.moments.max_abs).all()) and float(mixed.nonfinite.sum()) == 0
    for f in ("count", "mean", "m2", "max_abs"):
        torch.testing.assert_close(getattr(mixed.moments, f), getattr(alone.moments, f), rtol=0, atol=0)


def test_nonfinite_tokens_are_counted_and_excluded():
    hs, valid, role, type8 = _random_batch(1)
    valid[:] = 1
    hs[1][0, 0, 2] = float("inf")
    hs[1][1, 3, 0] = float("nan")
    stats = dim_moments_of(hs, valid, role, type8)
    assert stats.nonfinite.tolist() == [0, 2, 0]
    assert torch.isfinite(stats.moments.mean).all()
    x = hs[1].reshape(-1, hs[1].shape[-1])
    keep = torch.isfinite(x).all(-1)
    np.testing.assert_allclose(stats.moments.mean[1, 0], x[keep].double().mean(0).numpy(), rtol=1e-12)


def test_the_outlier_ranks_break_ties_by_dimension():
    """Two dimensions equally far from the median (one above, one below) get ranks in the order of their numbers,
    whatever order the rows come in (the view's ranks were an arbitrary pick between ties: two runs of the same
    corpus differed in them)."""
    import duckdb

    from actlake.analysis.dim_moments import DimMoments

    con = duckdb.connect()
    means = {9: 0.5, 7: -0.5, 5: 0.0, 3: 0.1, 1: -0.1}  # dims 9 and 7 tie; inserted from the highest dimension
    con.execute("CREATE TABLE dim_moments AS SELECT * FROM (VALUES " + ", ".join(
        f"('*', 0, 'all', 'all', {d}, 10.0, {m})" for d, m in means.items()) + ") t(source, layer, scheme, category, "
        "dim, count, mean)")
    ranks = dict(con.execute(f"SELECT dim, rank FROM ({DimMoments.views['outliers']}) ORDER BY rank").fetchall())
    assert ranks[7] == 1 and ranks[9] == 2
