"""README's configuration references of every job (top layer: it reads the training jobs' configs).

``scripts/sync_readme.py`` writes them into README.md; ``tests/unit/test_readme.py`` checks they are current."""

from actlake.config import JobConfig, reference_markdown
from actlake.jobs.lm.config import LMConfig
from actlake.jobs.predictor.config import PredictorJobConfig
from actlake.jobs.synthetic.config import SyntheticConfig


def reference_blocks() -> dict[str, str]:
    """README marker -> configuration reference of each kind of job."""
    return {"config-reference": reference_markdown(JobConfig),
            "config-reference-lm": reference_markdown(LMConfig),
            "config-reference-predictor": reference_markdown(PredictorJobConfig),
            "config-reference-synthetic": reference_markdown(SyntheticConfig)}
