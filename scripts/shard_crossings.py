"""Count the package lines one shard's life crosses (issue 49's closing note): a shard of the quick start run in this
process as a worker runs it (read, forward pass with every default analysis, tables written, statistics merged into
the open group, the group committed), every Python call traced, and the calls from a function of one part of actlake
to a function of another counted: the ground (``actlake``'s own modules), ``actlake.analysis`` (its engine apart),
``actlake.jobs``, ``actlake.storage``.

    python scripts/shard_crossings.py [--shard 0] [--corpus GLOB] [--edges]

Prints the distinct crossing edges (caller -> callee function) and the calls along them, by pair of parts. A count
of call edges, not of data hand-offs: a function called in a loop is one edge and many calls.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter

PARTS = ("actlake.analysis.engine", "actlake.analysis", "actlake.jobs", "actlake.storage", "actlake")


def part(module: str | None) -> str | None:
    """The part of actlake a module belongs to, or None outside the package."""
    if not module or not (module == "actlake" or module.startswith("actlake.")):
        return None
    return next(p for p in PARTS if module == p or module.startswith(p + "."))


def trace_shard(shard_index: int, corpus: str | None = None) -> tuple[Counter, Counter]:
    """(calls by edge, calls by pair of parts) of one shard's life."""
    from actlake.config import load_config
    from actlake.jobs.extract.driver import Extractor
    from actlake.jobs.extract.group import OpenGroup
    from actlake.jobs.extract.plan import plan_with_inputs
    from actlake.jobs.extract.run import prepare_run_dir, plan_hash
    from actlake.model import load_model
    from actlake.storage.layout import RunLayout

    overrides = {"output.dir": tempfile.mkdtemp(), "output.run_id": "crossings"}
    if corpus:
        overrides["corpus.paths"] = [corpus]
    cfg = load_config(None, overrides=overrides)  # the embedded default: the quick start's job
    lm = load_model(cfg.model, lm_head=cfg.analyses.surprisal)
    extractor = Extractor(cfg, lm)
    shards, inputs = plan_with_inputs(cfg)
    layout, phash = RunLayout(cfg.run_dir), plan_hash(cfg, shards)
    prepare_run_dir(cfg, layout, shards, phash, inputs, ())
    group = OpenGroup(layout, phash)
    edges: Counter = Counter()

    def profile(frame, event, arg):
        if event != "call" or frame.f_back is None:
            return
        callee, caller = part(frame.f_globals.get("__name__")), part(frame.f_back.f_globals.get("__name__"))
        if callee and caller and callee != caller:
            edges[(f"{frame.f_back.f_globals['__name__']}.{frame.f_back.f_code.co_name}",
                   f"{frame.f_globals['__name__']}.{frame.f_code.co_name}", caller, callee)] += 1

    sys.setprofile(profile)
    try:
        extractor.process(shards[shard_index], layout, group)
        group.commit()
    finally:
        sys.setprofile(None)
    pairs: Counter = Counter()
    for (_, _, a, b), n in edges.items():
        pairs[(a, b, "edges")] += 1
        pairs[(a, b, "calls")] += n
    return edges, pairs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shard", type=int, default=0)
    ap.add_argument("--corpus", help="corpus files (a glob; default: the quick start's data/sample)")
    ap.add_argument("--edges", action="store_true", help="also list every edge")
    args = ap.parse_args()
    edges, pairs = trace_shard(args.shard, args.corpus)
    print(f"{'from':<26}{'to':<26}{'edges':>7}{'calls':>9}")
    for a, b in sorted({(a, b) for a, b, _ in pairs}):
        print(f"{a:<26}{b:<26}{pairs[(a, b, 'edges')]:>7}{pairs[(a, b, 'calls')]:>9}")
    print(f"{'all':<52}{len(edges):>7}{sum(edges.values()):>9}")
    if args.edges:
        for (src, dst, _, _), n in sorted(edges.items()):
            print(f"  {src} -> {dst}: {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
