"""The configuration references of every job (docs/configuration.md) (top layer: it reads the training jobs' configs).

``scripts/sync_docs.py`` writes them into docs/configuration.md; ``tests/unit/test_docs.py`` checks they are current."""

from actlake.config import JobConfig, reference_markdown
from actlake.jobs.train.lm.config import LMConfig
from actlake.jobs.train.predictor.config import PredictorJobConfig
from actlake.jobs.train.synthetic.config import SyntheticConfig


def reference_blocks() -> dict[str, str]:
    """Marker in docs/configuration.md -> configuration reference of each kind of job."""
    return {"config-reference": reference_markdown(JobConfig),
            "config-reference-lm": reference_markdown(LMConfig),
            "config-reference-predictor": reference_markdown(PredictorJobConfig),
            "config-reference-synthetic": reference_markdown(SyntheticConfig)}
