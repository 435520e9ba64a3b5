"""Write docs/findings.md's measured figures from the quick runs, so the docs say what a run gives.

    python scripts/findings.py [--runs runs] [--check]

reads ``RUNS/quickstart`` (``bash scripts/quickstart.sh``), ``RUNS/lm-quick`` + ``RUNS/predictor-quick``
(``bash scripts/predictive_quick.sh``), ``RUNS/lm-quick-sweep`` and ``RUNS/cls-intervention`` (the README's tour) and rewrites the blocks between ``<!-- NAME:start -->`` and
``<!-- NAME:end -->`` it knows (in docs/findings.md, and the README's tour answers); ``--check`` only says whether they are current (exit 1 if not). A block
whose runs are missing is left as it is.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import actlake

ROOT = Path(__file__).resolve().parents[1]
PAGES = (ROOT / "docs" / "findings.md", ROOT / "README.md")


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


MASSIVE_SQL = """SELECT layer, dim, mean, max_abs, share FROM massive_activations
WHERE scheme = 'role' AND category = 'bos' AND rank = 1 ORDER BY layer"""
"""The largest dimension on [CLS] per layer (the ``massive_activations`` view): docs/findings.md and the README."""


def massive(runs: Path) -> str:
    rows = actlake.query(runs / "quickstart", MASSIVE_SQL).to_pylist()
    sink = [r for r in rows if 1 <= r["layer"] <= 4]
    dims = sorted({r["dim"] for r in sink})
    cells = [f"  | {r['layer']} | {r['dim']} | {r['mean']:.2f} | {r['max_abs']:.2f} | {r['share']:.2f} |" for r in rows]
    return "\n".join([
        f"- **What drives the sink** (the `massive_activations` view, which ranks dimensions within each token role): "
        f"on [CLS], in layers 1–4, dimension {' and '.join(map(str, dims))} holds "
        f"{min(r['mean'] for r in sink):.1f} to {max(r['mean'] for r in sink):.1f} "
        f"({min(r['share'] for r in sink):.2f}–{max(r['share'] for r in sink):.2f} of [CLS]'s squared norm); the "
        "all-token `outliers` ranking never shows it, [CLS] being under 1 % of tokens. The README's query, with the "
        "largest |value| too:",
        "",
        "  | layer | dim | mean on [CLS] | max \\|value\\| | share of [CLS]'s ‖h‖² |",
        "  |---|---|---|---|---|",
        *cells])


OUTLIERS_SQL = """SELECT layer, string_agg(dim || ' (' || printf('%+.0f', robust_z) || ')', ', ' ORDER BY abs(robust_z) DESC)
         FILTER (WHERE abs(robust_z) > 5) AS dims, max(abs(robust_z)) AS top_z, max(abs(mean)) AS top_mean
FROM outliers GROUP BY layer ORDER BY layer"""
"""Seed 001's outlier dimensions per hidden state: robust z beyond ±5 (the ``outliers`` view)."""


def outliers(runs: Path) -> str:
    run = runs / "quickstart"
    rows = actlake.query(run, OUTLIERS_SQL).to_pylist()
    norms = [r["n"] for r in actlake.query(run, "SELECT layer, avg(norm) AS n FROM residual_norms GROUP BY layer"
                                            ).to_pylist()]
    d = actlake.query(run, "SELECT count(DISTINCT dim) AS d FROM outliers").to_pylist()[0]["d"]
    none = "none (largest \\|z\\| {:.0f})"
    cells = [f"  | {r['layer']} | {r['dims'] or none.format(r['top_z'])} |" for r in rows]
    return "\n".join([
        "- **Outlier dimensions** (seed 001; the `outliers` view, robust z beyond ±5, largest |z| first): every "
        f"per-dimension mean lies within ±{max(r['top_mean'] for r in rows):.1f}, against mean residual norms of "
        f"{min(norms):.0f}–{max(norms):.0f} over {d} dimensions.",
        "",
        "  | hidden state | dimensions (robust z) |",
        "  |---|---|",
        *cells])


def span(values, digits: int) -> str:
    """``lo–hi`` of ``values`` (one value where both round to it)."""
    lo, hi = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return lo if lo == hi else f"{lo}–{hi}"


def signed_span(values, digits: int = 2) -> str:
    """``+a to +b`` of same-signed ``values``, the smallest magnitude first."""
    lo, hi = min(values, key=abs), max(values, key=abs)
    return f"{lo:+.{digits}f} to {hi:+.{digits}f}"


MASS_SQL = """SELECT layer, key_category, 100 * avg(mean_mass) AS pct FROM attention_mass_by_key GROUP BY ALL"""
"""Percent of each query's attention per key category and layer, averaged over heads (seed 001's Fig. 2)."""


def attention_mass(runs: Path) -> str:
    run = runs / "quickstart"
    pct = {(r["layer"], r["key_category"]): r["pct"] for r in actlake.query(run, MASS_SQL).to_pylist()}
    share = actlake.query(run, "SELECT 100.0 * count(*) FILTER (WHERE role = 'bos') / count(*) AS pct FROM tokens"
                          ).to_pylist()[0]["pct"]
    layers = sorted({layer for layer, _ in pct})
    sink = [pct[(layer, "bos")] for layer in layers if 1 <= layer <= 4]
    last, first = layers[-1], layers[0]

    return (f"- **Attention mass** (Fig. 2): [CLS] draws {span(sink, 0)} % of every query's attention in layers 1–4 "
            f"({pct[(last, 'bos')]:.0f} % in layer {last}, {pct[(first, 'bos')]:.0f} % in layer {first}): "
            f"{span([v / share for v in sink], 0)} times its share of tokens. [SEP] gets "
            f"{span([pct[(layer, 'eos')] for layer in layers], 1)} % and punctuation about its share "
            f"({span([pct[(layer, c)] for layer in layers for c in ('period', 'comma')], 0)} %). In this model the sink is "
            "[CLS], not [SEP] as in seed 001's BERT-base.")


GEOMETRY_SQL = """SELECT layer, key_category, sum(k_norm_sum) / sum(n_pairs) AS k_norm, sum(cos_sum) / sum(n_pairs) AS cos,
       avg(mass / n_queries) AS mass, avg(mass_keynorm / n_queries) AS mass_keynorm
FROM attention_geometry GROUP BY ALL"""
"""Per layer and key category, over heads: mean key norm and cos(q, k) over pairs, mass as computed and with every
key at its sequence's mean norm (seed 002)."""


def norm_or_angle(runs: Path) -> str:
    g = {(r["layer"], r["key_category"]): r for r in actlake.query(runs / "quickstart", GEOMETRY_SQL).to_pylist()}
    layers = sorted({layer for layer, _ in g})
    mid = [layer for layer in layers if 1 <= layer <= 4]
    others = sorted({c for _, c in g} - {"bos"})

    def shift(layer):
        return f"{g[(layer, 'bos')]['mass']:.2f} → {g[(layer, 'bos')]['mass_keynorm']:.2f}"

    helped = [layer for layer in layers if g[(layer, "bos")]["mass_keynorm"] < g[(layer, "bos")]["mass"]]
    raised = [layer for layer in mid if g[(layer, "bos")]["mass_keynorm"] > g[(layer, "bos")]["mass"]]
    return (f"- **Norm or angle** (seed 002): in layers 1–4 [CLS] keys are *shorter* than ordinary ones (mean ‖k‖ "
            f"{span([g[(la, 'bos')]['k_norm'] for la in mid], 1)} against {span([g[(la, 'other')]['k_norm'] for la in mid], 1)}) "
            f"and point towards the queries (mean cos(q, k) {signed_span([g[(la, 'bos')]['cos'] for la in mid])}, "
            f"against {signed_span([g[(la, c)]['cos'] for la in mid for c in others])} for every other category). "
            "Rescaling every key to its sequence's mean norm *raises* [CLS]'s share in layers "
            f"{', '.join(map(str, raised))} ({'; '.join(f'layer {la}: {shift(la)}' for la in raised)}): the sink is "
            f"direction, and key norms work against it. Only in layers {' and '.join(map(str, helped))} is [CLS] "
            f"helped by its key norm ({', '.join(shift(la) for la in helped)} when normalised).")


CONTRIB_SQL = """SELECT layer, dim, key_category, avg(mean_contribution) AS c FROM contributions_mean
WHERE query_category = 'all' AND dim IN (SELECT dim FROM outliers WHERE rank <= 2) GROUP BY ALL"""
"""Mean contribution of the top outlier dimensions to a key's score, per layer and key category, over heads."""


def contributions(runs: Path) -> str:
    run = runs / "quickstart"
    top = {(r["layer"], r["rank"]): r["dim"] for r in actlake.query(run, "SELECT layer, dim, rank FROM outliers "
                                                                          "WHERE rank <= 2").to_pylist()}
    c = {(r["layer"], r["dim"], r["key_category"]): r["c"] for r in actlake.query(run, CONTRIB_SQL).to_pylist()}
    last = max(layer for layer, _, _ in c)
    d1, d2, late = top[(1, 1)], top[(1, 2)], top[(last, 1)]
    start = last
    while (start - 1, 1) in top and top[(start - 1, 1)] == late:
        start -= 1
    span_of = range(start, last + 1)
    loud = [c[(la, late, k)] for la in span_of for k in ("eos", "period", "comma")]
    return (f"- **Contributions** (Table 1; `contributions_mean`, the largest outlier dimensions of `outliers`): they "
            f"lower the scores of ordinary keys and leave [CLS]'s alone: in layer 1 dim {d1} adds "
            f"{c[(1, d1, 'other')]:+.1f} to an ordinary key's score and {c[(1, d1, 'eos')]:+.1f} to [SEP]'s but "
            f"{c[(1, d1, 'bos')]:+.2f} to [CLS]'s; dim {d2} {c[(1, d2, 'other')]:+.1f} against {c[(1, d2, 'bos')]:+.2f}. "
            f"From layer {start} dim {late} adds to every key, most to [SEP] and punctuation ({signed_span(loud, 1)}) and "
            f"least to [CLS] ({signed_span([c[(la, late, 'bos')] for la in span_of], 1)}).")


def tour_answers(runs: Path) -> str:
    """The README's answers to its two tour questions (by source, what drives the sink)."""
    run = runs / "quickstart"
    src = [r for r in actlake.query(run, BY_SOURCE_SQL).to_pylist() if r["source"] != "*"]
    sink = [r for r in actlake.query(run, MASSIVE_SQL).to_pylist() if 1 <= r["layer"] <= 4]
    dim = " / ".join(map(str, sorted({r["dim"] for r in sink})))
    return (f"On the sample, {src[0]['source']} puts {src[0]['cls_mass_1_4']:.3f} of each query's attention on [CLS] "
            f"(layers 1–4), {src[-1]['source']} {src[-1]['cls_mass_1_4']:.3f}; dimension {dim} holds "
            f"{100 * min(r['share'] for r in sink):.0f}–{100 * max(r['share'] for r in sink):.0f} % of [CLS]'s squared "
            "norm there, a value the all-token `outliers` ranking never shows ([Findings](docs/findings.md)).")


SWEEP_SQL = """SELECT layer, step, avg(mean_mass) AS mass FROM attention_mass_by_key JOIN checkpoints USING (checkpoint)
WHERE key_category = 'bos' GROUP BY ALL ORDER BY 1, 2"""
"""Mass on the first token per layer and snapshot of the quick LM (the README's sweep query, unrounded)."""


def _sweep(runs: Path) -> tuple[dict, list[int], list[int]]:
    rows = actlake.query(runs / "lm-quick-sweep", SWEEP_SQL).to_pylist()
    mass = {(r["layer"], r["step"]): r["mass"] for r in rows}
    return mass, sorted({r["layer"] for r in rows}), sorted({r["step"] for r in rows})


def sweep_answers(runs: Path) -> str:
    """The README's answers to its sweep and side-by-side questions: when the quick LM's first-token mass rises
    above its step-0 value, and how far it is from MiniLM's [CLS] sink."""
    mass, layers, steps = _sweep(runs)
    base = [mass[(la, steps[0])] for la in layers]
    grown = [la for la in layers if mass[(la, steps[-1])] >= 1.5 * mass[(la, steps[0])]]
    rest = [la for la in layers if la not in grown]
    first = sorted({next(s for s in steps if mass[(la, s)] >= 1.5 * mass[(la, steps[0])]) for la in grown})
    cls = [r["cls_mass_1_4"] for r in actlake.query(runs / "quickstart", BY_SOURCE_SQL).to_pylist() if r["source"] == "*"]
    names = lambda ls: " and ".join(map(str, ls))  # noqa: E731
    grew = (f"Layers {names(grown)} reach {span([mass[(la, steps[-1])] for la in grown], 3)} by step {steps[-1]}, "
            f"passing 1.5 times step 0 at step {names(first)}" if grown else "No layer reaches 1.5 times step 0")
    stayed = (f"; layers {names(rest)} end at {span([mass[(la, steps[-1])] for la in rest], 3)} (at most "
              f"{span([max(mass[(la, s)] for s in steps) for la in rest], 3)} on the way)" if rest else "")
    return (f"On the sample, the quick LM's first token gets {span(base, 3)} of each query's attention in every layer at "
            f"step 0 (attention about uniform over the window). {grew}{stayed}. MiniLM's [CLS] gets {cls[0]:.3f} on "
            f"average over layers 1–4: {steps[-1]} steps of a {len(layers)}-layer LM give the start of a sink, not one "
            "([Findings](docs/findings.md)).")


INTERVENTION_SQL = """SELECT intervention, layer, clean_mean, edited_mean, diff_mean, ci_low, ci_high, n_docs
FROM intervention_effects WHERE quantity = 'attention_mass' AND key_category = 'bos' AND head = -1 AND layer > 0
ORDER BY 1, 2"""
"""The mass on [CLS] (mean over heads) per layer, clean and with dimension 99 or the control zeroed on [CLS] from
hidden state 1 on (configs/cls_intervention.yaml; the README's query, unrounded)."""


def _interventions(runs: Path) -> dict:
    rows = actlake.query(runs / "cls-intervention", INTERVENTION_SQL).to_pylist()
    return {(r["intervention"], r["layer"]): r for r in rows}


def intervention_answers(runs: Path) -> str:
    """The README's answer to the causal question: does dimension 99 make attention go to [CLS]?"""
    fx = _interventions(runs)
    layers = sorted({la for _, la in fx})
    first, last = fx[("dim99_on_cls", layers[0])], fx[("dim99_on_cls", layers[-1])]
    control = max(max(abs(r["ci_low"]), abs(r["ci_high"])) for (iv, _), r in fx.items() if iv == "dim69_on_cls")
    return (f"On {int(first['n_docs'])} documents of the sample, zeroing dimension 99 on [CLS] takes the mass on [CLS] "
            f"at layer {layers[0]} from {first['clean_mean']:.3f} to {first['edited_mean']:.3f} (change "
            f"{first['diff_mean']:.3f}, 95 % interval {first['ci_low']:.3f} to {first['ci_high']:.3f}) and at layer "
            f"{layers[-1]} from {last['clean_mean']:.3f} to {last['edited_mean']:.3f}; the control dimension 69 moves it "
            f"by at most {math.ceil(control * 1e4) / 1e4:.4f} in any layer (interval bounds included): without dimension "
            "99 on [CLS] the sink is gone ([Findings](docs/findings.md)).")


def intervention_table(runs: Path) -> str:
    fx = _interventions(runs)
    layers = sorted({la for _, la in fx})
    cell = lambda r: f"{r['edited_mean']:.3f} ({r['ci_low']:+.4f} to {r['ci_high']:+.4f})"  # noqa: E731
    return "\n".join([
        "| layer | clean | dimension 99 zeroed on [CLS] (change, 95 % interval) | dimension 69 zeroed (control) |",
        "|---|---|---|---|",
        *[f"| {la} | {fx[('dim99_on_cls', la)]['clean_mean']:.3f} | {cell(fx[('dim99_on_cls', la)])} | "
          f"{cell(fx[('dim69_on_cls', la)])} |" for la in layers]])


def sweep_table(runs: Path) -> str:
    mass, layers, steps = _sweep(runs)
    return "\n".join([
        "| layer | " + " | ".join(f"step {s}" for s in steps) + " |",
        "|---|" + "---|" * len(steps),
        *[f"| {la} | " + " | ".join(f"{mass[(la, s)]:.3f}" for s in steps) + " |" for la in layers]])


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
          "outliers": (outliers, ("quickstart",)),
          "attention-mass": (attention_mass, ("quickstart",)),
          "norm-or-angle": (norm_or_angle, ("quickstart",)),
          "contributions": (contributions, ("quickstart",)),
          "massive": (massive, ("quickstart",)),
          "tour-answers": (tour_answers, ("quickstart",)),
          "predictive-measured": (predictive, ("lm-quick", "predictor-quick")),
          "sweep-answers": (sweep_answers, ("lm-quick-sweep", "quickstart")),
          "sweep-table": (sweep_table, ("lm-quick-sweep",)),
          "intervention-answers": (intervention_answers, ("cls-intervention",)),
          "intervention-table": (intervention_table, ("cls-intervention",))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default=str(ROOT / "runs"))
    p.add_argument("--check", action="store_true")
    args = p.parse_args(argv)
    runs = Path(args.runs)
    texts = {page: page.read_text() for page in PAGES}
    stale = []
    for name, (make, needs) in BLOCKS.items():
        if not all((runs / r / "summary.json").is_file() or (runs / r / "sweep.json").is_file() for r in needs):
            print(f"{name}: skipped (no {', '.join(needs)} under {runs})", file=sys.stderr)
            continue
        (page,) = [p for p, t in texts.items() if f"<!-- {name}:start -->" in t]
        head, rest = texts[page].split(f"<!-- {name}:start -->")
        old, tail = rest.split(f"<!-- {name}:end -->")
        new = f"\n{make(runs)}\n"
        if old != new:
            stale.append(name)
        texts[page] = f"{head}<!-- {name}:start -->{new}<!-- {name}:end -->{tail}"
    if args.check:
        print("stale: " + ", ".join(stale) if stale else "current")
        return 1 if stale else 0
    for page, text in texts.items():
        page.write_text(text)
    print(f"updated {', '.join(p.name for p in PAGES)}" + (f" ({', '.join(stale)})" if stale else " (no change)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
