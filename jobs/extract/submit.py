"""``actlake submit/status/logs``: the same job through the Ray Jobs API.

The code travels as a runtime_env ``py_modules`` entry (this installed actlake
package, staged as one folder), the config as the ``working_dir``. Paths in the
config are absolute (the config model resolves them when it reads the file) or object-store URLs:
local ones must exist on the cluster (a shared filesystem or
object store mount), as with any Ray job.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import yaml

from actlake.config import JobConfig, resolve_model_path

log = logging.getLogger("actlake.submit")


def stage_package(dest: Path) -> Path:
    """Copy the importable ``actlake`` package (with jobs/analysis/storage) into ``dest/actlake``."""
    pkg = dest / "actlake"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    # the package's folder, looked up rather than imported: ``actlake/__init__.py`` is the top layer
    home = importlib.util.find_spec("actlake").submodule_search_locations[0]
    shutil.copytree(home, pkg, ignore=ignore)
    for sub in ("jobs", "analysis", "storage"):
        mod = __import__(f"actlake.{sub}", fromlist=["_"])
        target = pkg / sub
        if not target.exists():
            shutil.copytree(Path(mod.__file__).parent, target, ignore=ignore)
    return pkg


def absolute_config(cfg: JobConfig) -> dict:
    """The config the cluster runs: its paths as the config model resolved them (absolute local paths,
    object-store URLs as written), the model folder, and this run id (the cluster must not derive another)."""
    d = cfg.to_dict()
    d["name"] = cfg.name
    d["model"]["name_or_path"] = resolve_model_path(cfg.model.name_or_path)
    d["output"]["run_id"] = cfg.run_id
    d["resources"]["address"] = None  # inside the job, Ray connects to its own cluster
    for custom in d["analyses"]["custom"]:
        custom["path"] = None  # the code travels as a py_modules entry of the job (see submit)
    return d


def auth_token() -> str | None:
    """Ray's cluster token: RAY_AUTH_TOKEN, the file at RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token"))
    return path.read_text().strip() if path.is_file() else None


def client(address: str):
    """A Jobs API client that sends the cluster token when one is known (Ray token authentication)."""
    from ray.job_submission import JobSubmissionClient

    token = auth_token()
    headers = {"Authorization": f"Bearer {token}"} if token else None
    return JobSubmissionClient(address, headers=headers)


def submit(cfg: JobConfig, address: str, submission_id: str | None = None, agent_wait_s: float = 120) -> str:
    client_ = client(address)
    with tempfile.TemporaryDirectory(prefix="actlake-submit-") as tmp:
        tmp = Path(tmp)
        work = tmp / "work"
        work.mkdir()
        (work / "job.yaml").write_text(yaml.safe_dump(absolute_config(cfg), sort_keys=False))
        pkg = stage_package(tmp / "modules")
        deadline = time.monotonic() + agent_wait_s
        while True:
            try:
                return client_.submit_job(
                    entrypoint="python -m actlake.jobs.cli run job.yaml",
                    submission_id=submission_id,
                    runtime_env={"working_dir": str(work),
                                 "py_modules": [str(pkg)] + [path for _, _, path in cfg.code_refs if path],
                                 "env_vars": {"TOKENIZERS_PARALLELISM": "false"}},
                    metadata={"actlake_run_id": cfg.run_id},
                )
            except RuntimeError as e:  # a head that just started has no job agent yet
                if "No available agent" not in str(e) or time.monotonic() > deadline:
                    raise
                log.info("the cluster's job agent is not up yet; retrying")
                time.sleep(2)


def status(address: str, submission_id: str) -> str:
    return str(client(address).get_job_status(submission_id).value)


def logs(address: str, submission_id: str) -> str:
    return client(address).get_job_logs(submission_id)


def stop(address: str, submission_id: str) -> str:
    """Stop a submitted job (what ``ray job stop`` does); finished shards stay committed."""
    stopped = client(address).stop_job(submission_id)
    return "stop requested" if stopped else "already finished"
