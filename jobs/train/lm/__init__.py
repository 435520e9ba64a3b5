"""``actlake train-lm``: config, training loop, job driver."""
