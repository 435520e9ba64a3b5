"""SAE training data end to end: the job that stores activations, both exports, and the plain forward pass over the
same windows, side by side in one run; bytes per token; a corpus-scale estimate from the rates measured.

    .venv/bin/python benchmarks/export_throughput.py [CONFIG] [--max-docs N] [--out DIR] [--json FILE]

CONFIG defaults to configs/sae_sample.yaml (MiniLM, hidden state 3, 40 sample documents; run the quick start first
for data/sample). The job runs as ``actlake run`` does (embedded Ray, report off); the plain forward pass in this
process over the job's windows rebuilt from its ``tokens`` table (``benchmarks/end_to_end.py``'s); then
``export --format tokens`` and ``--format saelens`` of the store's first layer, in this process. Prints tokens/s of
each against the plain forward pass, what the store and each export hold per token, and what a corpus of
``--estimate-tokens`` tokens (default 300e9, about the Pile with the GPT-NeoX tokenizer) would take at these rates
and widths: disk per layer, and the export's core-hours (the export is CPU and disk work: a GPU does not speed it).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from end_to_end import job_windows, plain_forward, run_once, worker_threads  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def folder_bytes(folder: Path, pattern: str = "*") -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob(pattern) if p.is_file())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", default=str(ROOT / "configs" / "sae_sample.yaml"))
    p.add_argument("--max-docs", type=int, help="corpus.max_docs (a CI-sized run)")
    p.add_argument("--corpus", help="corpus.paths, one glob (default: the config's)")
    p.add_argument("--out", help="folder for the run and the exports (default: a temporary one, removed)")
    p.add_argument("--json", help="write the measurements here")
    p.add_argument("--estimate-tokens", type=float, default=300e9)
    args = p.parse_args(argv)

    import torch

    from actlake.config import load_config
    from actlake.jobs.export import export_saelens, export_tokens
    from actlake.model import load_model

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        overrides = {"output.dir": str(out)}
        if args.max_docs:
            overrides["corpus.max_docs"] = args.max_docs
        if args.corpus:
            overrides["corpus.paths"] = [args.corpus]
        cfg = load_config(args.config, overrides=overrides)
        layer = cfg.activations.layers[0]
        threads = worker_threads(cfg)
        job = run_once(cfg, f"export-throughput-{int(time.time())}")
        if threads > 0:
            torch.set_num_threads(threads)
        lm = load_model(cfg.model)
        plain = plain_forward(lm, job_windows(job["run_dir"], cfg), lm.tokenizer.pad_token_id or 0)
        run = Path(job["run_dir"])
        t0 = time.perf_counter()
        tokens = export_tokens(run, layer, out / "tokens", drop_roles=())
        t_tokens = time.perf_counter() - t0
        t0 = time.perf_counter()
        saelens = export_saelens(run, layer, out / "saelens")
        t_saelens = time.perf_counter() - t0
        n, d = job["summary"]["tokens"], tokens["d_model"]
        store_layers = len(cfg.activations.layers)
        m = {"tokens": n, "d_model": d, "job_s": job["wall"], "plain_s": plain, "export_tokens_s": t_tokens,
             "export_saelens_s": t_saelens, "exported_rows": tokens["rows"],
             "saelens_tokens": saelens["rows"] * saelens["context_size"],
             "store_bytes_per_token_layer": folder_bytes(run / "tables" / "activations", "*.parquet") / n / store_layers,
             "tokens_bytes_per_token": folder_bytes(out / "tokens") / tokens["rows"],
             "saelens_bytes_per_token": folder_bytes(out / "saelens") / max(saelens["rows"] * saelens["context_size"], 1)}
    _print(m, args.estimate_tokens)
    if args.json:
        Path(args.json).write_text(json.dumps(m, indent=1))
    return 0


def _print(m: dict, corpus: float) -> None:
    n = m["tokens"]
    rate = {"plain forward": n / m["plain_s"], "job with the store (wall)": n / m["job_s"],
            "export --format tokens": m["exported_rows"] / m["export_tokens_s"],
            "export --format saelens": m["saelens_tokens"] / m["export_saelens_s"]}
    print(f"{n:,} tokens, width {m['d_model']}")
    for name, r in rate.items():
        print(f"  {name:28s} {r:12,.0f} tokens/s   {rate['plain forward'] / r:6.2f}x plain")
    print(f"  bytes/token per layer: store {m['store_bytes_per_token_layer']:,.0f} (Parquet, zstd), tokens export "
          f"{m['tokens_bytes_per_token']:,.0f}, saelens export {m['saelens_bytes_per_token']:,.0f}")
    per = m["tokens_bytes_per_token"] / (4 * m["d_model"])
    for d in (m["d_model"], 1024, 4096):
        tb = corpus * 4 * d * per / 1e12
        hours = corpus / (rate["export --format tokens"] * m["d_model"] / d) / 3600
        print(f"  {corpus:.3g} tokens at width {d}: tokens export {tb:,.0f} TB per layer, about {hours:,.0f} hours of "
              "this export rate (it is bytes-bound: rate x width held constant)")


if __name__ == "__main__":
    raise SystemExit(main())
