"""Deprecated: moved to :mod:`actlake.jobs.extract.try_analysis` in 0.2.0; this name goes in the release after."""

import warnings

from actlake.jobs.extract.try_analysis import try_analysis  # noqa: F401

warnings.warn("actlake.jobs.try_analysis moved to actlake.jobs.extract.try_analysis", DeprecationWarning, stacklevel=2)
