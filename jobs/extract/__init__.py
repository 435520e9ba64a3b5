"""The extraction job: plan, dispatch, workers, reduce, report, sweeps and cluster submission."""
