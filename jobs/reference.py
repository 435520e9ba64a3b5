"""The configuration references of every job (docs/configuration.md) and the tables and views of an extraction run
(docs/sql-schema.md) (top layer: it reads the training jobs' configs).

``scripts/sync_docs.py`` writes them into those pages; ``tests/unit/test_docs.py`` checks they are current."""

import json

from actlake.config import JobConfig, reference_markdown
from actlake.jobs.train.lm.config import LMConfig
from actlake.jobs.train.predictor.config import PredictorJobConfig
from actlake.jobs.train.synthetic.config import SyntheticConfig


def analyses_reference() -> str:
    """The built-in producers a config names under ``analyses:`` (the registry's), each with its options."""
    from actlake.analysis.registry import TOGGLED_TABLES, builtin

    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for cls in list(builtin().values()) + list(TOGGLED_TABLES):
        lines.append(f"| `analyses.{cls.name}` | bool or mapping | `{json.dumps(cls.default_on)}` | "
                     f"{cls.about.replace('|', chr(92) + '|')} |")
        for name, f in cls.Options.model_fields.items():
            doc = " ".join((f.description or "").split()).replace("``", "`").replace("|", "\\|")
            lines.append(f"| `analyses.{cls.name}.{name}` | {f.annotation.__name__} | `{json.dumps(f.default)}` | {doc} |")
    return "\n".join(lines)


def reference_blocks() -> dict[str, str]:
    """Marker in docs/configuration.md -> configuration reference of each kind of job."""
    return {"config-reference": reference_markdown(JobConfig), "analyses-reference": analyses_reference(),
            "config-reference-lm": reference_markdown(LMConfig),
            "config-reference-predictor": reference_markdown(PredictorJobConfig),
            "config-reference-synthetic": reference_markdown(SyntheticConfig)}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def table_row(table: str, doc, shard: bool) -> str:
    """One row of docs/sql-schema.md's table of tables from a :class:`~actlake.analysis.protocol.TableDoc`;
    ``shard``: a shard table, whose folder's ``shard=NNNNN`` DuckDB shows as a last column."""
    columns = ", ".join([f"`{c}`" + (f" ({meaning})" if meaning else "") for c, meaning in doc.columns.items()]
                        + ["`shard`"] * shard)
    text = (f"{doc.intro}: " if doc.intro else "") + columns + (f". {doc.note}" if doc.note else "")
    return f"| `{table}` | {_cell(doc.rows)} | {_cell(text)} |"


def sql_schema_blocks() -> dict[str, str]:
    """Marker in docs/sql-schema.md -> its rows from the built-in producers' declarations (``table_docs``,
    ``view_docs``): the shard tables, then the analyses' tables, then their views, each in the registry's order."""
    from actlake.analysis.registry import builtin_producers

    producers = sorted(builtin_producers(), key=lambda cls: not cls.per_token)  # stable: the registry's order within
    tables = ["| table | one row per | columns (units) |", "|---|---|---|"]
    tables += [table_row(t, cls.table_docs[t], cls.per_token) for cls in producers for t in cls.tables]
    views = ["| view | what it is (the question it answers) |", "|---|---|"]
    views += [f"| `{v}` | {_cell(cls.view_docs[v])} |" for cls in producers for v in getattr(cls, "views", {})]
    return {"sql-tables": "\n".join(tables), "sql-views": "\n".join(views)}
