"""Shard progress: a tqdm bar on a terminal, one log line per shard otherwise."""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("actlake.progress")


class Progress:
    def __init__(self, total: int, skipped: int = 0, stream=None):
        from tqdm import tqdm

        self.total, self.done, self.tokens, self.start = total, skipped, 0, time.monotonic()
        # disable=None: a bar only when the stream is a terminal
        self.bar = tqdm(total=total, initial=skipped, unit="shard", file=stream or sys.stderr, disable=None,
                        dynamic_ncols=True, desc="shards")

    def update(self, summary: dict) -> None:
        self.tokens += summary.get("tokens", 0)
        elapsed = time.monotonic() - self.start
        rate = f"{self.tokens / elapsed if elapsed > 0 else 0.0:,.0f} tokens/s"
        self.bar.set_postfix_str(rate, refresh=False)
        self.bar.update(1)
        self.done += 1
        if self.bar.disable:  # a disabled bar counts nothing
            log.info("shards %d/%d  %s", self.done, self.total, rate)
        if self.done >= self.total:
            self.bar.close()
