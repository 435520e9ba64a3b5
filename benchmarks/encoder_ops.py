"""Operations per layer of the encoder route against the explicit path, counted on a CPU.

The encoder route (``padded_products``, analysis/engine/kernels.py) serves bidirectional layers on a GPU;
without one, this counts what a layer issues: Triton kernel launches (stubbed, not run) and every other
PyTorch operation (``TorchDispatchMode``), against the explicit path's operations for the same four products
(mass, mass_keynorm, weighted_qsum, distance). Run: ``TRITON_INTERPRET=1 .venv/bin/python benchmarks/encoder_ops.py``
(default: MiniLM's 12 heads of 32, four windows of up to 128 tokens).
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 100, 64, 90])
    args = p.parse_args(argv)

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from actlake.analysis.engine import kernels
    from actlake.analysis.engine.layer_qk import BatchInfo, LayerQK
    from actlake.categories import one_hot

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    launches = []
    kernels._run = lambda kernel, *a, **k: launches.append(kernel)  # counted, not run
    names = ("mass", "mass_keynorm", "weighted_qsum", "distance")
    B, T, H, dh = len(args.lengths), max(args.lengths), args.heads, args.head_dim
    valid = (torch.arange(T)[None] < torch.tensor(args.lengths)[:, None]).long()
    onehot = one_hot(torch.randint(0, 5, (B, T)), 5, valid)
    counts = {}
    for method in ("padded", "explicit"):
        q, k = torch.randn(B, H, T, dh), torch.randn(B, H, T, dh)
        lq = LayerQK(0, q, k, dh ** -0.5, BatchInfo(valid, False, onehot, onehot), native=(q, k, None),
                     method=method, needs=frozenset(names), triton=True)
        kernels._verified.add(("bidirectional attention", q.device))  # no first-use check against explicit weights
        launches.clear()
        with Count() as c:
            for name in names:
                lq.product(name)
        counts[method] = (len(launches), c.n)
    print(f"heads {H} x {dh}, windows {args.lengths}; per layer, all four products:")
    for method, (n_kernels, n_ops) in counts.items():
        print(f"  {method:9s} Triton launches {n_kernels:3d}   other operations {n_ops:4d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
