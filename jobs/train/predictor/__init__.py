"""``actlake train-predictor`` (seed 003): config, predictor model, probes, metrics, training loop, job driver, report."""
