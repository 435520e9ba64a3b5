"""What reaches a user's console besides actlake's own lines (issue 53: Ray's noise on every run). The jobs'
consoles are checked whole in tests/integration/test_documented_commands.py; here the pieces, on Ray's real
objects (no cluster started)."""

import logging
import time
from pathlib import Path

from actlake.jobs.common import ray_env
from actlake.jobs.train.loop import Pace

NOISE = ("[2026-11-29 07:57:45,890 E 30336 30366] core_worker.cc:2465: Actor with class name: 'PreemptionWatcher' "
         "and ID: 'a32f7cab621cf562c35ea87101000000' has constructor arguments in the object store and max_restarts > 0. If "
         "the arguments in the object store go out of scope or are lost, the actor restart will fail.")


def test_forwarded_worker_output_loses_only_ray_s_known_noise():
    """Through Ray's own dispatcher of forwarded worker output: the constructor-argument line goes, every other
    line (an error included) comes through in order, control characters escaped (principle 3 of issue 50); a batch
    left empty is not printed at all."""
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    seen = []
    saved = list(dispatcher.handlers)
    dispatcher.handlers = [("ray_print_logs", seen.append)]
    try:
        assert ray_env.quiet_forwarded_logs()
        assert ray_env.quiet_forwarded_logs() is False  # once: not wrapped twice
        kept = ["lm step 38/250: train loss 6.982", "[2026-11-29 07:57:45 E 1 2] core_worker.cc:99: a real error"]
        label = "shard 3: source 'evil\x1b[2J\x9b31m' has no documents"
        dispatcher.emit({"lines": [kept[0], NOISE, kept[1], label], "pid": 7, "is_err": True})
        dispatcher.emit({"lines": [NOISE], "pid": 7, "is_err": True})
    finally:
        dispatcher.handlers = saved
    assert [d["lines"] for d in seen] == [kept + ["shard 3: source 'evil\\x1b[2J\\x9b31m' has no documents"]]
    assert seen[0]["pid"] == 7


def test_a_ray_train_worker_console_keeps_warnings_and_our_lines_but_not_ray_s_info():
    """Ray Train logs each report at INFO through a logger named by its file: off the console; a warning of Ray's
    and an INFO line of ours stay."""
    import ray

    root = logging.getLogger()
    handler = logging.StreamHandler()
    records = []
    handler.emit = records.append
    root.addHandler(handler)
    try:
        ray_env.quiet_ray_info_on_console()
        ray_env.quiet_ray_info_on_console()
        assert sum(isinstance(f, ray_env.RayInfoFilter) for f in handler.filters) == 1
        inside = f"{ray.__path__[0]}/train/v2/_internal/execution/context.py"
        for name, path, level in ((inside, inside, logging.INFO), (inside, inside, logging.WARNING),
                                  ("actlake.training", __file__, logging.INFO)):
            handler.handle(logging.LogRecord(name, level, path, 1, "m", (), None))
    finally:
        root.removeHandler(handler)
    assert [(r.levelno, r.name) for r in records] == [(logging.WARNING, inside), (logging.INFO, "actlake.training")]


def test_the_training_pace_gives_the_loss_since_the_last_line_and_the_time_left():
    """A resumed attempt (from step 40 of 100), 2 s a step on a simulated clock."""
    clock = [0.0]
    pace = Pace(40, 100, every_s=15.0, clock=lambda: clock[0])
    assert pace.eta() == "" and not pace.due()
    for i, loss in enumerate((3.0, 5.0, 4.0, 6.0)):
        clock[0] += 2.0
        pace.step(loss)
    assert pace.mean_loss() == 4.5 and not pace.due()
    assert pace.eta() == ", ETA 00:01:52"  # 56 steps left at 2 s each
    clock[0] += 8.0
    assert pace.due()
    pace.said()
    assert not pace.due() and pace.losses == []
    for _ in range(56):
        pace.step(1.0)
    assert pace.eta() == ""  # none left


def test_an_embedded_ray_s_workers_spin_on_an_idle_machine_unless_the_driver_says_otherwise(monkeypatch):
    """OpenMP's wait policy of the workers: libgomp's spinning on an idle machine (one job alone computes faster),
    passive when another Ray runs or other processes are running (docs/benchmarks.md: spinning stalls beside other
    CPU work), the driver's OMP_WAIT_POLICY or GOMP_SPINCOUNT when set."""
    from actlake.jobs.common import ray_env

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setattr(ray_env, "other_rays", lambda: [])
    monkeypatch.setattr(ray_env, "running_elsewhere", lambda: 0)
    assert ray_env.local_worker_env() == {"TOKENIZERS_PARALLELISM": "false"}
    monkeypatch.setattr(ray_env.os, "sched_getaffinity", lambda pid: set(range(32)), raising=False)
    monkeypatch.setattr(ray_env, "running_elsewhere", lambda: 3)  # 3 threads on 32 cores: still the job's
    assert ray_env.busy() == "" and ray_env.local_worker_env() == {"TOKENIZERS_PARALLELISM": "false"}
    monkeypatch.setattr(ray_env.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(ray_env, "running_elsewhere", lambda: 2)
    assert ray_env.busy() == "2 other threads running on 2 cores"
    assert ray_env.local_worker_env()["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setattr(ray_env, "running_elsewhere", lambda: 0)
    monkeypatch.setattr(ray_env, "other_rays", lambda: [4242])
    assert ray_env.local_worker_env()["OMP_WAIT_POLICY"] == "PASSIVE" and "4242" in ray_env.busy()
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")
    assert ray_env.local_worker_env()["GOMP_SPINCOUNT"] == "10000" and "OMP_WAIT_POLICY" not in ray_env.local_worker_env()
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert ray_env.local_worker_env()["OMP_WAIT_POLICY"] == "ACTIVE"


def test_processes_running_elsewhere_are_counted():
    """Three busy loops in other processes are at least three threads running or ready to run (Linux's count)."""
    import subprocess
    import sys

    import pytest

    from actlake.jobs.common.ray_env import running_elsewhere

    if not Path("/proc/loadavg").exists():
        pytest.skip("no /proc/loadavg here")
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    try:
        time.sleep(0.5)
        assert running_elsewhere(samples=9) >= 3
    finally:
        for p in loops:
            p.kill()
            p.wait()


def test_durations_past_a_day_keep_their_hours():
    """The ETA of a long job: 100,000 s is 27:46:40, not 03:46:40 (a clock's hours wrap at 24)."""
    from actlake.jobs.common.clock import hms

    assert [hms(s) for s in (0, 59.6, 3599, 100_000, -3)] == ["00:00:00", "00:01:00", "00:59:59", "27:46:40", "00:00:00"]
    pace = Pace(0, 10_000, clock=lambda: 0.0)
    pace.done, pace.t0, pace.clock = 1, 0.0, lambda: 10.0
    assert pace.eta() == ", ETA 27:46:30"  # 9,999 steps left at 10 s each
