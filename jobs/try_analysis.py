"""Deprecated: moved to :mod:`actlake.jobs.extract.try_analysis` in 0.2.0; this name goes in the release after."""

from actlake.deprecation import deprecated
from actlake.jobs.extract.try_analysis import try_analysis  # noqa: F401

deprecated("actlake.jobs.try_analysis moved to actlake.jobs.extract.try_analysis", stacklevel=2)
