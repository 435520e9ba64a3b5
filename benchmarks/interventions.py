"""An intervention job against the clean job on the same documents (issue 51's cost goal: at most 2x for one
intervention at the middle layer).

    .venv/bin/python benchmarks/interventions.py [CONFIG] [--max-docs 100] [--repeats 2] [--at L] [--out DIR]

CONFIG defaults to the embedded default job (MiniLM over the sample corpus). Each round runs the job twice through
:func:`~actlake.jobs.extract.run.run_job` (embedded Ray, workers, commits, reduce; report off), alternating: as
configured, and with one intervention added (dimension 0 zeroed on every token at hidden state ``--at``, default
the middle one). Prints each run's wall time and its workers' compute seconds (``summary.json``), and the ratios.
The edited pass starts at ``at`` from the clean pass's snapshot (``analysis/engine/resume.py``): only the layers
from ``at`` on run twice.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(cfg, run_id: str, interventions: list) -> tuple[float, float]:
    """(wall seconds, workers' compute seconds) of one job."""
    from actlake.jobs.extract.run import run_job

    cfg = cfg.model_copy(update={"output": cfg.output.model_copy(update={"run_id": run_id, "report": False}),
                                 "interventions": interventions})
    t0 = time.perf_counter()
    res = run_job(cfg, report=False)
    return time.perf_counter() - t0, res.totals["seconds"]["compute"]


def main(argv=None) -> int:
    from actlake.architectures import read_model_config
    from actlake.config import InterventionConfig, load_config, resolve_model_path

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", nargs="?", default=None)
    p.add_argument("--max-docs", type=int, default=100)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--at", type=int, default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    cfg = load_config(a.config, {"corpus.max_docs": a.max_docs})
    depth = read_model_config(resolve_model_path(cfg.model.name_or_path)).num_hidden_layers
    at = depth // 2 if a.at is None else a.at
    iv = [InterventionConfig(name="bench", at=at, op="zero", dims=[0])]
    out = Path(a.out or tempfile.mkdtemp(prefix="actlake-bench-"))
    cfg = cfg.model_copy(update={"output": cfg.output.model_copy(update={"dir": str(out)})})
    rows = []
    for r in range(a.repeats):
        clean = run(cfg, f"clean-{r}", [])
        edited = run(cfg, f"edited-{r}", iv)
        rows.append((clean, edited))
        print(f"round {r}: clean {clean[0]:.1f} s (compute {clean[1]:.1f} s), one intervention at hidden state {at} "
              f"{edited[0]:.1f} s (compute {edited[1]:.1f} s): wall {edited[0] / clean[0]:.2f}x, compute "
              f"{edited[1] / clean[1]:.2f}x", flush=True)
    wall = statistics.median(e[0] / c[0] for c, e in rows)
    compute = statistics.median(e[1] / c[1] for c, e in rows)
    print(f"median over {a.repeats} rounds ({a.max_docs} documents, {cfg.model.name_or_path}): one intervention costs "
          f"{wall:.2f}x the clean job's wall time and {compute:.2f}x its compute (goal: at most 2x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
