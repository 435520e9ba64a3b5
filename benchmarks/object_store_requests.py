"""Requests to an object store of one ``actlake sql`` and one ``actlake report`` on a run that lies there.

    .venv/bin/python benchmarks/object_store_requests.py RUN_DIR [--query SQL]

Copies a finished local run (``RUN_DIR``: its tables, commit records and run records, the records last) into a
bucket of moto's S3 server on 127.0.0.1, then runs ``actlake sql s3://…/RUN QUERY`` (a child process, as from a
shell) twice, the first checking every file's page checksums as a new reader does, and ``actlake report
s3://…/RUN``, and prints the requests the server received for each, by method, and
the most HEAD requests any one Parquet file got. Each request is a round trip to a real store. Run it with
another checkout's interpreter (``OTHER/.venv/bin/python benchmarks/object_store_requests.py``) to count
that checkout's requests on the same run.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import Counter
from pathlib import Path


def _server():
    """moto's server on 127.0.0.1 with the AWS variables pointing at it; its requests as (method, path)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    requests: list[tuple[str, str]] = []
    app = server._server.app  # the WSGI application its HTTP server calls for every request

    def recorded(environ, start_response):
        requests.append((environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")))
        return app(environ, start_response)

    server._server.app = recorded
    host, port = server.get_host_and_port()
    os.environ.update({"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "bench",
                       "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
                       "AWS_EC2_METADATA_DISABLED": "true"})
    return server, requests


def _upload(run: Path, url: str) -> None:
    """The run's files under ``url``: tables first, then the commit records, the reduce record last (the order a
    job writes them in)."""
    from actlake.fs import location

    files = [p for p in run.rglob("*") if p.is_file() and not p.relative_to(run).parts[0] in ("report", "_staging")]
    order = {"tables": 0, "_complete": 1}
    for p in sorted(files, key=lambda p: (order.get(p.relative_to(run).parts[0], 2), p.name == "reduced.json", str(p))):
        location(f"{url}/{p.relative_to(run)}").write_bytes(p.read_bytes())


def _tally(requests: list) -> str:
    by = Counter(m for m, _ in requests)
    heads = Counter(p for m, p in requests if m == "HEAD" and p.endswith(".parquet"))
    return (f"{len(requests)} requests ({', '.join(f'{n} {m}' for m, n in sorted(by.items()))}); "
            f"most HEADs of one Parquet file: {max(heads.values(), default=0)}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--query", default="SELECT count(*) FROM tokens")
    p.add_argument("--settle", type=float, default=15.0,
                   help="seconds to wait after the upload: DuckDB does not cache the footer of a file written "
                        "in the last seconds")
    args = p.parse_args(argv)
    server, requests = _server()
    try:
        import boto3

        from actlake.jobs.cli import main as actlake

        boto3.client("s3").create_bucket(Bucket="bench")
        url = f"s3://bench/{args.run_dir.resolve().name}"
        _upload(args.run_dir.resolve(), url)
        time.sleep(args.settle)
        steps = (("sql (first: checks every file's page checksums)", ["sql", url, args.query]),
                 ("sql (again)", ["sql", url, args.query]), ("report", ["report", url]))
        for what, argv_ in steps:
            del requests[:]
            if actlake(argv_) != 0:
                raise SystemExit(f"actlake {argv_[0]} failed")
            print(f"actlake {what}: {_tally(requests)}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
