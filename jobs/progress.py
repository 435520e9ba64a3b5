"""Progress: a one-line bar on a terminal, plain log lines otherwise."""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("actlake.progress")


class Progress:
    def __init__(self, total: int, skipped: int = 0, stream=None):
        self.total, self.done, self.tokens = total, skipped, 0
        self.start = time.monotonic()
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.started_at = skipped

    def update(self, summary: dict) -> None:
        self.done += 1
        self.tokens += summary.get("tokens", 0)
        elapsed = time.monotonic() - self.start
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        ran = self.done - self.started_at
        left = self.total - self.done
        eta = elapsed / ran * left if ran else float("nan")
        msg = f"shards {self.done}/{self.total}  {rate:,.0f} tokens/s  ETA {eta:,.0f}s"
        if self.tty:
            width = 30
            filled = int(width * self.done / max(1, self.total))
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {msg}   ")
            self.stream.flush()
            if self.done == self.total:
                self.stream.write("\n")
        else:
            log.info(msg)
