"""Analyses: pure functions from captured tensors to mergeable sufficient statistics."""
