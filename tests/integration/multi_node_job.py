"""Run one job on a ``ray.cluster_utils.Cluster`` of two worker nodes whose working folder is not the driver's.

Run as ``python -m tests.integration.multi_node_job CONFIG.json RESULT.json DRIVER_DIR WORKER_DIR`` (its
own process: the test session already holds an embedded Ray). Ray starts the workers in the folder
the driver connected from (WORKER_DIR); the job then runs from DRIVER_DIR. The config puts corpus and
results in an object store, so the two folders must stay empty.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(cfg_path: str, out_path: str, driver_dir: str, worker_dir: str) -> None:
    import ray
    from ray.cluster_utils import Cluster

    from actlake.config import parse_config
    from actlake.jobs.extract.run import run_job

    cfg = parse_config(json.loads(Path(cfg_path).read_text()))
    os.chdir(worker_dir)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        os.chdir(driver_dir)
        summaries = []
        res = run_job(cfg, on_shard=summaries.append)
        Path(out_path).write_text(json.dumps({"shards_run": res.shards_run, "nodes": [s["node_id"] for s in summaries]}))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:5])
