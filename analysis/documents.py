"""The tables of reading: ``documents`` (one row per document read) and ``rejects`` (one per record skipped)."""

from __future__ import annotations

import pyarrow as pa

from actlake.analysis.protocol import ShardTable, TableDoc


class Documents(ShardTable):
    name = "documents"
    tables = ("documents",)
    of_reading = True
    schema = pa.schema([("doc_id", pa.int64()), ("file", pa.string()), ("record", pa.int64()),
                        ("source", pa.string()), ("n_chars", pa.int64()), ("n_windows", pa.int32()),
                        ("n_tokens", pa.int64()), ("cut", pa.bool_())])
    table_docs = {"documents": TableDoc("document used", {
        "doc_id": "", "file": "", "record": "line / row in the file, from 0", "source": "", "n_chars": "",
        "n_windows": "", "n_tokens": "", "cut": "true when the document was longer than the windows allowed"})}

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
    table_docs = {"rejects": TableDoc("skipped record", {
        "file": "", "record": "",
        "reason": "`malformed_json`: not JSON, nested too deeply to parse or an integer beyond Python's 4,300-digit "
                  "limit; `invalid_utf8`: bytes that are not UTF-8; `invalid_text`: text or source label that cannot "
                  "be written as UTF-8, e.g. a lone surrogate `\\ud800` escape; `not_an_object`; `missing_text`; "
                  "`empty_text`; `too_few_tokens`; `tokenizer_error`: the tokenizer raised on the text",
        "detail": "why, at most 200 characters"})}

    def collect_read(self, docs: list[dict], rejects: list[dict]) -> None:
        self.rows = rejects
