"""A worker's open commit group: the shards' statistics merged here, their files and the commit in storage."""

from __future__ import annotations

from actlake.storage.layout import RunLayout
from actlake.storage.shards import CommitPolicy, Group


def _sets(stats: dict | None) -> int:
    """Sets of statistics in ``{name: BySource}`` (one per source label each; at least 1)."""
    return max(1, max((len(getattr(s, "parts", (0,))) for s in (stats or {}).values()), default=1))


class OpenGroup:
    """The shards a worker ran since its last commit (:class:`~actlake.storage.shards.Group`: files, summaries, the
    commit) and their statistics, merged on the model's device; committed as Arrow partials."""

    def __init__(self, layout: RunLayout, plan_hash: str, policy: CommitPolicy | None = None):
        self.files = Group(layout, plan_hash, policy or CommitPolicy())
        self.lock = self.files.lock
        self.stats: dict | None = None  # analysis name -> merged statistics
        self.set_bytes: float | None = None  # one set of partials' bytes, estimated once: the same whatever the data

    def add(self, shard_id: int, files: dict, summary: dict, stats: dict) -> None:
        """A finished shard: its published files, summary and statistics (merged first: a merge that fails, as
        ``analyses.max_sources`` may, leaves the shard out of the group)."""
        with self.lock:
            if self.stats is None:
                if self.set_bytes is None:
                    self.set_bytes = sum(t.nbytes for s in stats.values() for t in s.to_tables().values()) / _sets(stats)
                merged = stats
            else:
                merged = {name: self.stats[name].merge(part) for name, part in stats.items()}
            self.stats = merged
            self.files.add(shard_id, files, summary)

    def due(self) -> bool:
        return self.files.due((self.set_bytes or 0) * _sets(self.stats))

    def commit(self) -> list[int]:
        """The merged statistics as partial tables, then the record; the shard ids now complete (see Group.commit)."""
        with self.lock:
            try:
                partials = {t: data for s in (self.stats or {}).values() for t, data in s.to_tables().items()}
                return self.files.commit(partials)
            finally:  # also when the partials could not be made: the dispatcher runs the shards again
                self.stats = None
                self.files.clear()
