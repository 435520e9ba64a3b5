"""Run one job on a 4-node ``ray.cluster_utils.Cluster`` (a head without CPUs, three 1-CPU nodes, a worker
each) and lose two worker nodes: one as soon as the job has planned (its worker is starting, or not
placed yet), one after two groups are committed (its worker is running a shard).

Run as ``python -m tests.integration.node_loss_job CONFIG.json RESULT.json`` (its own process:
the test session already holds an embedded Ray).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path


def _stage(what: str) -> None:
    """A line the test quotes if this process hangs."""
    print(f"node_loss_job: {time.strftime('%H:%M:%S')} {what}", file=sys.stderr, flush=True)


def main(cfg_path: str, out_path: str) -> None:
    import ray
    from ray.cluster_utils import Cluster

    from actlake.config import parse_config

    cfg = parse_config(json.loads(Path(cfg_path).read_text()))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        _run(cfg, cluster, out_path)
    finally:
        _stage("ray.shutdown")
        ray.shutdown()
        _stage("cluster.shutdown")
        cluster.shutdown()
        _stage("done")


def _run(cfg, cluster, out_path: str) -> None:
    import ray

    from actlake.jobs.extract.run import run_job

    nodes = [cluster.add_node(num_cpus=1) for _ in range(3)]
    cluster.wait_for_nodes()
    _stage("nodes up")
    ray.init(address=cluster.address)
    result: dict = {"removed_after_shards": None}

    def remove_nodes():
        complete = Path(cfg.run_dir) / "_complete"
        while not (Path(cfg.run_dir) / "run.json").exists():
            time.sleep(0.05)
        cluster.remove_node(nodes[2])
        _stage("a node removed as the workers start")
        while len(list(complete.glob("group-*.json"))) < 2:
            time.sleep(0.1)
        result["removed_after_shards"] = len(list(complete.glob("group-*.json")))
        _stage(f"removing a node after {result['removed_after_shards']} groups")
        cluster.remove_node(nodes[1])
        _stage("node removed")

    remover = threading.Thread(target=remove_nodes, daemon=True)
    remover.start()
    try:
        _stage("job starts")
        res = run_job(cfg)
        _stage("job returned")
        result.update(shards_total=res.shards_total, shards_run=res.shards_run)
    finally:
        remover.join(timeout=60)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        avail, total = ray.available_resources().get("CPU", 0), ray.cluster_resources().get("CPU", 0)
        if avail == total:
            break
        time.sleep(0.5)
    result.update(cpu_available=avail, cpu_total=total, alive_nodes=sum(n["Alive"] for n in ray.nodes()))
    Path(out_path).write_text(json.dumps(result))
    _stage("result written")


if __name__ == "__main__":
    main(*sys.argv[1:3])
