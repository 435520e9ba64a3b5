"""The tables of reading: ``documents`` (one row per document read) and ``rejects`` (one per record skipped)."""

from __future__ import annotations

import pyarrow as pa

from actlake.analysis.protocol import ShardTable


class Documents(ShardTable):
    name = "documents"
    tables = ("documents",)
    of_reading = True
    schema = pa.schema([("doc_id", pa.int64()), ("file", pa.string()), ("record", pa.int64()),
                        ("source", pa.string()), ("n_chars", pa.int64()), ("n_windows", pa.int32()),
                        ("n_tokens", pa.int64()), ("cut", pa.bool_())])

    def collect_read(self, docs: list[dict], rejects: list[dict]) -> None:
        self.rows = docs

    @classmethod
    def to_table(cls, parts: list["Documents"], **options) -> pa.Table:
        return pa.Table.from_pylist([r for p in parts for r in p.rows], schema=cls.schema)


class Rejects(Documents):
    name = "rejects"
    tables = ("rejects",)
    schema = pa.schema([("file", pa.string()), ("record", pa.int64()), ("reason", pa.string()),
                        ("detail", pa.string())])

    def collect_read(self, docs: list[dict], rejects: list[dict]) -> None:
        self.rows = rejects
