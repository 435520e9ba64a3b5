"""``actlake export RUN --format tokens|saelens --layer L -o DIR``: a run's activation store as what sparse-autoencoder
trainers read (issue 52): token-level shuffled shards for any trainer (:func:`export_tokens`, ``tokens.py``), or
SAELens's activation cache (:func:`export_saelens`, ``saelens.py``); ``store.py`` holds what both share.

The store must be complete (every planned shard committed: :func:`~actlake.storage.activations.verify_store`) and
finite; it is read a store file at a time, a record batch at a time (local or object storage). The output is a new
local folder, written into ``DIR.partial`` beside it and renamed to DIR when whole; an existing DIR is refused
(nothing is overwritten). A stopped export leaves ``DIR.partial``: the same command resumes it.
"""

from actlake.jobs.export.saelens import export_saelens
from actlake.jobs.export.tokens import export_tokens

__all__ = ["export_saelens", "export_tokens"]
