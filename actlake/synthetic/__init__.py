"""Synthetic factored processes (GHMMs) and their exact belief states (METHODS.md §7)."""
