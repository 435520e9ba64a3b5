"""``actlake train-synthetic`` (seed 004): factored processes (GHMMs) and their exact belief states, models,
training loop, analysis, job driver, report (METHODS.md §7)."""
