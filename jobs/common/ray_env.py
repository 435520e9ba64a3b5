"""Start or join Ray for every job (extraction and training): ``init_ray``."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from pathlib import Path

from actlake.errors import ActlakeError, printable

log = logging.getLogger("actlake.run")


workers_env: dict[str, str] = {}
"""The variables the last embedded Ray started here gave its workers (:func:`local_worker_env`)."""


def init_ray(address: str | None, dashboard: bool = False) -> bool:
    """Connect to ``address`` / RAY_ADDRESS, or start an embedded Ray bound to 127.0.0.1. True if we started it.

    The embedded Ray is always a new one, never a cluster found on this machine (``ray start``'s record).

    ``dashboard``: start the embedded Ray with its dashboard, whose state API Ray Train's
    controller polls (without it, Ray Train logs a warning every second)."""
    import ray

    ray_released()  # a Ray still shutting down reads as initialized
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True, logging_level=logging.WARNING)
        quiet_forwarded_logs()
        return True
    global workers_env
    workers_env = local_worker_env()
    with _single_machine_ray(), _quiet(TOKEN_AUTH_LOGGER):
        # address="local": always a new Ray. With None, Ray would join the last cluster that `ray start` or a
        # crashed test recorded in <ray temp dir>/ray_current_cluster, live or long dead.
        ray.init(address="local", include_dashboard=dashboard, dashboard_host="127.0.0.1",
                 _node_ip_address="127.0.0.1", log_to_driver=True, logging_level=logging.WARNING,
                 runtime_env={"env_vars": workers_env})
    quiet_forwarded_logs()
    node_ip = ray.util.get_node_ip_address()
    if node_ip not in ("127.0.0.1", "::1"):
        ray.shutdown()
        raise ActlakeError(f"the embedded Ray took node address {node_ip}, not 127.0.0.1, so its servers would listen "
                           f"beyond this machine; refusing to run (this Ray version, {ray.__version__}, needs a new fix)")
    return True


def local_worker_env() -> dict[str, str]:
    """Variables of an embedded Ray's workers: the driver's ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` when set;
    otherwise torch's OpenMP threads spin between parallel regions (libgomp's default, as on a cluster's workers
    and in a plain forward pass) on an idle machine, and sleep (``OMP_WAIT_POLICY=PASSIVE``, said in a line) where
    another Ray runs or other threads are running (:func:`busy`). Spinning computes 1.2-1.4x faster alone; beside
    other CPU work it stalls (2-3x slower: docs/benchmarks.md)."""
    env = {"TOKENIZERS_PARALLELISM": "false"}
    if "OMP_WAIT_POLICY" in os.environ:
        env["OMP_WAIT_POLICY"] = os.environ["OMP_WAIT_POLICY"]
    elif "GOMP_SPINCOUNT" in os.environ:
        env["GOMP_SPINCOUNT"] = os.environ["GOMP_SPINCOUNT"]
    elif why := busy():
        log.info("%s: the workers' threads sleep between operations (OMP_WAIT_POLICY=PASSIVE; set OMP_WAIT_POLICY "
                 "to choose)", why)
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    return env


def busy() -> str:
    """Why this machine's cores are not the job's alone ('' when they look free): another Ray, or other threads
    running now (:func:`running_elsewhere`; a load average would count the job just before this one) on an eighth
    of the cores this process may use or more (at least one: on 2 cores, any)."""
    others = other_rays()
    if others:
        return f"another Ray runs on this machine (raylet pid {others[0]})"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = running_elsewhere()
    return f"{n} other thread{'s' if n > 1 else ''} running on {cores} cores" if n >= max(1, cores // 8) else ""


def running_elsewhere(samples: int = 5, every_s: float = 0.01) -> int:
    """The threads running or ready to run on this machine besides the one asking, now: the median over
    ``samples`` reads of the kernel's count (``/proc/loadavg``'s fourth field, Linux); 0 where there is none."""
    counts = []
    for i in range(samples):
        try:
            counts.append(int(Path("/proc/loadavg").read_text().split()[3].split("/")[0]) - 1)
        except (OSError, IndexError, ValueError):
            return 0
        if i + 1 < samples:
            time.sleep(every_s)
    return max(0, sorted(counts)[len(counts) // 2])


def other_rays() -> list[int]:
    """The pids of the raylets running on this machine (any user's: they share its cores), but for those this
    process started (a Ray it shut down may still be exiting)."""
    import psutil

    ours = {c.pid for c in psutil.Process().children()}  # ray.init starts the raylet itself
    return [p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == "raylet" and p.pid not in ours]


_stopping: threading.Thread | None = None
"""A shutdown of Ray under way in the background (:func:`release_ray`)."""

_held: list[bool] | None = None
"""Inside :func:`holding_ray`: whether a job in the block started Ray (it is shut down when the block ends)."""


def release_ray(background: bool = False) -> None:
    """What a job that started Ray calls when it is done: ``ray.shutdown()``, or inside :func:`holding_ray`, at
    the block's end. ``background``: in a thread, while the caller goes on (Ray's graceful shutdown waits up to a
    second for each of its processes); :func:`init_ray` and :func:`ray_released` wait for it."""
    import ray

    global _stopping
    if _held is not None:
        _held[0] = True
    elif background:
        _stopping = threading.Thread(target=_shutdown, args=(ray,), name="ray-shutdown")
        _stopping.start()
    else:
        ray.shutdown()


def _shutdown(ray) -> None:
    try:
        ray.shutdown()
    except Exception as e:  # noqa: BLE001 - the job's result stands; the next init_ray starts a new Ray
        log.warning("Ray's shutdown failed: %s", e)


def ray_released() -> None:
    """Return once a shutdown :func:`release_ray` started in the background is over."""
    global _stopping
    if _stopping is not None:
        _stopping.join()
        _stopping = None


@contextlib.contextmanager
def holding_ray():
    """Jobs run in this block share the Ray the first of them starts (a sweep's checkpoints: one embedded Ray,
    not one per checkpoint); none is started when none needs one."""
    global _held
    outer, _held = _held, [False]
    try:
        yield
    finally:
        started, _held = _held[0], outer
        if started:
            release_ray()


RAY_NOISE = re.compile(r"core_worker\.cc:\d+: Actor with class name: '\w+' and ID: '\w+' has constructor arguments in the "
                       r"object store and max_restarts > 0")
"""Lines other processes of Ray print that say nothing to a user of a job: Ray Train's controller starts its
``PreemptionWatcher`` with an argument in the object store and restarts allowed, and Ray's C++ core logs it as an
error at every trial (ray-project/ray#53727; our own actors take no such argument)."""


def quiet_forwarded_logs() -> bool:
    """Leave :data:`RAY_NOISE` out of the worker output Ray forwards to this driver's console (Ray's log files
    keep it), and escape what a terminal would act on in the rest. False when this Ray forwards through something else (its dispatcher is not public API): then the
    lines show, as before."""
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return False
    with dispatcher._lock:
        for i, (name, handle) in enumerate(dispatcher.handlers):
            if name == "ray_print_logs" and not getattr(handle, "actlake_filter", False):
                dispatcher.handlers[i] = (name, _without_noise(handle))
                return True
    return False


def _without_noise(handle):
    """``handle`` behind a filter: :data:`RAY_NOISE` left out, every other line :func:`~actlake.errors.printable`
    (a worker's output may quote a corpus label or a file name: nothing reaches the terminal that it acts on)."""

    def filtered(data):
        lines = [printable(ln) for ln in data.get("lines", ()) if not RAY_NOISE.search(ln)]
        if lines:
            handle(dict(data, lines=lines))

    filtered.actlake_filter = True
    return filtered


class RayInfoFilter(logging.Filter):
    """On a Ray Train worker's console: no INFO lines logged by Ray's own modules (Ray Train logs each report
    through a logger named by its file, which escapes ``LoggingConfig``'s level). Ray's log files keep them."""

    def __init__(self):
        import ray

        super().__init__()
        self.ray_dir = os.path.dirname(ray.__file__) + os.sep

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.INFO or not record.pathname.startswith(self.ray_dir)


def quiet_ray_info_on_console() -> None:
    """In a Ray Train worker: :class:`RayInfoFilter` on the root logger's console handlers."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and not any(isinstance(f, RayInfoFilter) for f in handler.filters):
            handler.addFilter(RayInfoFilter())


TOKEN_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
"""Ray enables token authentication for a new local cluster and logs a warning saying it did, at every
start: nothing for a user to do (a user's ``RAY_AUTH_MODE`` is respected, and then Ray says nothing)."""


@contextlib.contextmanager
def _quiet(name: str):
    """The logger ``name`` says only errors inside the block."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _single_machine_ray():
    """Let ``ray.init(_node_ip_address="127.0.0.1")`` keep the loopback address.

    Ray replaces a loopback ``_node_ip_address`` by the machine's outward address
    (``ray._private.services.resolve_ip_for_localhost``) unless clusters are disabled
    (``ray_constants.ENABLE_RAY_CLUSTER``, the setting behind ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``,
    read once when Ray is imported). With the outward address the GCS, raylet and worker gRPC
    servers listen on every interface (``::``); with 127.0.0.1 every server Ray starts listens on
    loopback only (tests/integration/test_inputs.py lists them). Set for the duration of
    ``ray.init`` only: a later connection to a real cluster from this process must see the
    machine's address again.
    """
    from ray._private import ray_constants

    if not hasattr(ray_constants, "ENABLE_RAY_CLUSTER"):  # another Ray: init_ray checks the address it took
        log.warning("this Ray has no ray_constants.ENABLE_RAY_CLUSTER; starting it as it is")
        yield
        return
    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


STORE_SETTINGS = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION",
                  "AWS_EC2_METADATA_DISABLED")
"""Object-store settings forwarded from the driver to the workers on any Ray."""
STORE_CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                     "GOOGLE_APPLICATION_CREDENTIALS", "HF_TOKEN")
"""Credentials forwarded only to an embedded Ray (the same machine): on a cluster each node brings its
own (an instance role, or the variables in ``cluster.yaml``), so secrets never enter Ray's job metadata."""


def store_env(local: bool) -> dict[str, str]:
    """The driver's object-store variables the workers get, as an argument of the worker actor, which sets
    them in its own process. Never as ``runtime_env`` ``env_vars``: Ray writes those in plain text to
    ``runtime_env_agent.log`` (world-readable, and kept after the job)."""
    names = STORE_SETTINGS + (STORE_CREDENTIALS if local else ())
    return {k: os.environ[k] for k in names if k in os.environ}
