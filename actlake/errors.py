"""One exception hierarchy for the package.

Every class keeps its constructor arguments in ``args`` so instances pickle and
unpickle unchanged: Ray moves exceptions between processes.
"""

import re

_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
"""Characters a terminal acts on instead of showing: C0 controls (escape, carriage return, newline, ...), DEL, C1
controls (``\x9b`` is a CSI too), bidirectional marks and overrides, line and paragraph separators."""


def printable(text: str) -> str:
    """``text`` safe to print on a terminal, on one line: each character a terminal would act on (an escape
    sequence that clears the screen or retitles the window, a carriage return that overwrites the line, a newline
    that forges another, a bidirectional override) as its Python escape (``\x1b``, ``\r``, ``\n``, ``\u202e``);
    the rest unchanged. For what reaches a terminal only: CSV, JSON and Parquet output are data, kept as they are."""
    return _UNPRINTABLE.sub(lambda m: ascii(m.group())[1:-1], text)


def printable_lines(text: str) -> str:
    """:func:`printable` line by line: the newlines of a message of several lines (a line per failed shard) or of a
    drawn table are kept, every other character a terminal acts on is escaped."""
    return "\n".join(printable(line) for line in text.split("\n"))


class ActlakeError(Exception):
    """Base class of every error actlake raises on purpose."""

    deterministic = False
    """True where the error repeats the same way on every try (a bad config, a model that cannot load, an
    analysis's bug): neither a worker's retry nor a rerun of the job can help, so none is made or advised."""


class ConfigError(ActlakeError):
    """The job config is invalid: the message names the file, key and line."""

    deterministic = True


class CorpusError(ActlakeError):
    """A corpus file is missing, unreadable or corrupt: the message names it."""


class ModelLoadError(ActlakeError):
    """The model could not be loaded (missing folder, unsupported family, unsafe weights)."""

    deterministic = True


class StorageError(ActlakeError):
    """A run directory is inconsistent: missing shards, damaged files, a conflicting plan."""


class QueryError(ActlakeError):
    """A SQL query was refused or failed."""


class AnalysisError(ActlakeError):
    """Captured tensors do not fit what an analysis assumes (e.g. an attention mask it cannot describe)."""

    deterministic = True


class AnalysisFailed(AnalysisError):
    """An analysis (or shard table, built in or custom) raised: the message names it, the file and line, and
    the method that failed; ``traceback`` is the whole traceback, as text."""

    def __init__(self, message: str, traceback: str = ""):
        super().__init__(message, traceback)

    def __str__(self) -> str:
        return self.args[0]

    @property
    def traceback(self) -> str:
        return self.args[1]


class TrainingError(ActlakeError):
    """A training trial failed; the message names the trial and the first error line."""
