"""Write docs/findings.md's measured figures from the quick runs, so the docs say what a run gives.

    python scripts/findings.py [--runs runs] [--check]

reads ``RUNS/quickstart`` (``bash scripts/quickstart.sh``) and ``RUNS/lm-quick`` + ``RUNS/predictor-quick``
(``bash scripts/predictive_quick.sh``) and rewrites the blocks between ``<!-- NAME:start -->`` and
``<!-- NAME:end -->`` it knows; ``--check`` only says whether they are current (exit 1 if not). A block
whose runs are missing is left as it is.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import actlake

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "findings.md"


def quickstart_headline(runs: Path) -> str:
    run = runs / "quickstart"
    s = json.loads((run / "summary.json").read_text())
    share = actlake.query(run, """
        SELECT role, 100.0 * count(*) / sum(count(*)) OVER () AS pct FROM tokens GROUP BY role""").to_pylist()
    pct = {r["role"]: r["pct"] for r in share}
    return (f"What the quick start gives ({s['docs']:,} documents of the shipped sample, {s['tokens']:,} tokens in "
            f"{s['windows']:,} windows; [CLS] {pct.get('bos', 0):.2f} % and [SEP] {pct.get('eos', 0):.2f} % of tokens, "
            f"periods {pct.get('period', 0):.1f} %, commas {pct.get('comma', 0):.1f} %).")


BY_SOURCE_SQL = """SELECT source, round(avg(mean_mass) FILTER (WHERE layer BETWEEN 1 AND 4), 3) AS cls_mass_1_4,
       round(avg(mean_mass) FILTER (WHERE layer = 5), 3) AS cls_mass_5
FROM attention_mass_by_key_by_source WHERE key_category = 'bos' GROUP BY source ORDER BY cls_mass_1_4 DESC"""
"""Mass on [CLS] per source (``analyses.by_source``): docs/findings.md and the README's tour."""


def by_source(runs: Path) -> str:
    rows = actlake.query(runs / "quickstart", BY_SOURCE_SQL).to_pylist()
    cells = [f"| {r['source']}{' (every document)' if r['source'] == '*' else ''} | {r['cls_mass_1_4']:.3f} | "
             f"{r['cls_mass_5']:.3f} |" for r in rows]
    labelled = [r for r in rows if r["source"] != "*"]
    top, low = labelled[0], labelled[-1]
    return "\n".join([
        f"- **By source** (`analyses.by_source`, on in the quick start): the sink is strongest on {top['source']} "
        f"({top['cls_mass_1_4']:.3f} of each query's attention on [CLS], layers 1–4) and weakest on {low['source']} "
        f"({low['cls_mass_1_4']:.3f}); `actlake sql runs/quickstart` with the README's query:",
        "",
        "  | source | mass on [CLS], layers 1–4 | layer 5 |",
        "  |---|---|---|",
        *[f"  {c}" for c in cells]])


def predictive(runs: Path) -> str:
    lm = json.loads((runs / "lm-quick" / "summary.json").read_text())
    pred = runs / "predictor-quick"
    summary = actlake.query(pred, "SELECT layer, r2, spearman FROM predictor_summary ORDER BY layer").to_pylist()
    probes = actlake.query(pred, "SELECT layer, task, representation, macro_f1 FROM probe_scores").to_pylist()
    f1 = {(p["layer"], p["task"], p["representation"]): p["macro_f1"] for p in probes}
    names = {0: "0 (embeddings)", max(r["layer"] for r in summary): f"{max(r['layer'] for r in summary)} (last block)"}
    rows = []
    for r in summary:
        reps = lambda task: " / ".join(f"{f1.get((r['layer'], task, rep), float('nan')):.2f}"  # noqa: E731
                                       for rep in ("h", "h_hat", "r", "h_hat+r"))
        rows.append(f"| {names.get(r['layer'], str(r['layer']) + ' (middle)')} | {r['r2']:.2f} | {r['spearman']:.2f} | "
                    f"{reps('source')} | {reps('type8')} |")
    last = lm["last"]
    return "\n".join([
        f"What the quick run gives (`scripts/predictive_quick.sh` on the shipped sample corpus): the LM reached a "
        f"held-out loss of {last['eval_loss']:.3f} nats/token at step {lm['step']} (`runs/lm-quick/summary.json`). "
        "Against seed 003 (Pythia-410m; METHODS.md §6), probes on the predictor's held-out windows only (a few "
        "hundred windows per task here, so the F1s are coarse):",
        "",
        "| hidden state | R² (paper: low at 0, ≈ 0.3 at 6–18, ≈ 0.4 at 23) | Spearman ρ(‖r‖, surprisal) | "
        "source macro-F1 h / ĥ / r / [ĥ, r] | type8 macro-F1 h / ĥ / r / [ĥ, r] |",
        "|---|---|---|---|---|",
        *rows,
        "",
        "5 source classes here (the sample corpus), not The Pile's 22."])


BLOCKS = {"quickstart-headline": (quickstart_headline, ("quickstart",)),
          "by-source": (by_source, ("quickstart",)),
          "predictive-measured": (predictive, ("lm-quick", "predictor-quick"))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default=str(ROOT / "runs"))
    p.add_argument("--check", action="store_true")
    args = p.parse_args(argv)
    runs, text = Path(args.runs), PAGE.read_text()
    stale = []
    for name, (make, needs) in BLOCKS.items():
        if not all((runs / r / "summary.json").is_file() for r in needs):
            print(f"{name}: skipped (no {', '.join(needs)} under {runs})", file=sys.stderr)
            continue
        head, rest = text.split(f"<!-- {name}:start -->")
        old, tail = rest.split(f"<!-- {name}:end -->")
        new = f"\n{make(runs)}\n"
        if old != new:
            stale.append(name)
        text = f"{head}<!-- {name}:start -->{new}<!-- {name}:end -->{tail}"
    if args.check:
        print("stale: " + ", ".join(stale) if stale else "current")
        return 1 if stale else 0
    PAGE.write_text(text)
    print(f"updated {PAGE}" + (f" ({', '.join(stale)})" if stale else " (no change)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
