"""The extraction job: plan, dispatch, workers, reduce, report, sweeps, cluster submission and try-analysis."""
