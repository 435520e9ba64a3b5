"""The configuration references of every job (docs/configuration.md) (top layer: it reads the training jobs' configs).

``scripts/sync_docs.py`` writes them into docs/configuration.md; ``tests/unit/test_docs.py`` checks they are current."""

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
