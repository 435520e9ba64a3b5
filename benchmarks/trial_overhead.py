"""What one Ray Train trial costs before and after its training loop: wall time and CPU-seconds by process.

    .venv/bin/python benchmarks/trial_overhead.py [--trials 3]

Runs ``--trials`` trials one after another through :func:`actlake.jobs.train.training.run_trials` (as every training
job does), each with a loop that reports once and returns, on an embedded Ray of 2 CPUs. A thread samples
every process's CPU times every 0.1 s; a process's CPU-seconds are its last sample minus its CPU time when the
trials began (zero for one started later). A process that lived between two samples is missed, and so may be
a process's last 0.1 s: the totals are a floor. Prints the wall time of each trial and the CPU-seconds per
trial by process kind (Ray's process titles, such as ``ray::TrainController``), the sampler's process included."""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from collections import Counter


def report_once(config: dict) -> None:
    """A trial's loop that does nothing but report one metric."""
    import ray.train

    ray.train.report({"done": 1})


def _naming(kind: str) -> tuple[int, int]:
    """How well ``kind`` names a process: an actor's class, then ray::IDLE, then a command line; longer first."""
    return (2 if kind.startswith("ray::") and kind != "ray::IDLE" else int(kind == "ray::IDLE"), len(kind))


class CpuSampler:
    """CPU-seconds of every process, by kind, from periodic samples."""

    def __init__(self, every_s: float = 0.1):
        self.every_s, self.last, self.kinds = every_s, {}, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            for p in psutil.process_iter(["name", "cmdline", "cpu_times", "create_time"]):
                cmd, cpu = p.info["cmdline"] or [p.info["name"] or "?"], p.info["cpu_times"]
                if cpu is None:
                    continue
                key = (p.pid, p.info["create_time"])
                # a Ray worker's title: its command line, then ray::IDLE, then its actor's class (cut short while
                # it is being set), then class.method while a method runs: the longest class seen names it
                kind = (cmd[0].split(".")[0] if cmd[0].startswith("ray::")
                        else " ".join(c.rsplit("/", 1)[-1] for c in cmd[:2]))
                self.kinds[key] = max(self.kinds.get(key, ""), kind, key=_naming)
                self.last[key] = cpu.user + cpu.system
            time.sleep(self.every_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def by_kind(self, since: dict) -> Counter:
        """CPU-seconds since the snapshot ``since`` of :attr:`last`: a process in it counts from it, one started
        later from its start."""
        out: Counter = Counter()
        for key, cpu in self.last.items():
            out[self.kinds[key].strip()[:40]] += cpu - since.get(key, 0.0)
        return out


def main(argv: list[str] | None = None) -> None:
    import ray

    from actlake.jobs.train.training import Resources, Trial, run_trials

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args(argv)
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        with CpuSampler() as sampler, tempfile.TemporaryDirectory() as run_dir:
            time.sleep(3)  # Ray's own start-up is not the trials'
            before = dict(sampler.last)
            for i in range(args.trials):
                t0 = time.perf_counter()
                run_trials([Trial(f"t{i}", report_once)], run_dir, Resources(num_workers=1, cpus_per_worker=1))
                print(f"trial {i}: {time.perf_counter() - t0:.1f} s wall", flush=True)
            time.sleep(2)  # processes that end after the last trial
        cpu = sampler.by_kind(before)
    finally:
        ray.shutdown()
    print(f"\nCPU-seconds per trial ({args.trials} trials), by process:")
    for kind, seconds in cpu.most_common():
        if seconds / args.trials >= 0.05:
            print(f"  {seconds / args.trials:6.2f}  {kind}")
    print(f"  {sum(cpu.values()) / args.trials:6.2f}  in all")


if __name__ == "__main__":
    main()
