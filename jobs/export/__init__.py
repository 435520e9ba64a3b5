"""``actlake export RUN --format tokens|saelens --layer L -o DIR``: a run's activation store as what sparse-autoencoder
trainers read (issue 52): token-level shuffled shards for any trainer (:func:`export_tokens`, ``tokens.py``), or
SAELens's activation cache (:func:`export_saelens`, ``saelens.py``); ``store.py`` holds what both share.

The store must be complete (every planned shard committed: :func:`~actlake.storage.activations.verify_store`) and
finite; it is read a store file at a time, a record batch at a time (local or object storage). The output is a new
folder, written into ``DIR.partial`` beside it and renamed to DIR when whole, or a new object-store prefix (made in a
scratch folder and uploaded, the manifest last); an existing one is refused (nothing is overwritten). A stopped
export leaves its partial folder: the same command resumes it.
"""

from actlake.jobs.export.saelens import export_saelens
from actlake.jobs.export.tokens import export_tokens

__all__ = ["describe", "export_saelens", "export_tokens"]


def describe(out, format: str, m: dict) -> str:
    """One line saying what an export wrote (``m``: what its function returned)."""
    if format == "saelens":
        return (f"export:  {out}  ({m['rows']:,} windows of {m['context_size']} tokens in {m['files']} file(s), "
                f"{m['hook_name']}, width {m['d_model']}; left out {m['left_out_shorter']:,} shorter and "
                f"{m['left_out_longer']:,} longer window(s))")
    dropped = f"; {', '.join(m['drop_roles'])} tokens left out" if m["drop_roles"] else ""
    return (f"export:  {out}  ({m['rows']:,} rows of width {m['d_model']} in {len(m['shards'])} shard(s), "
            f"{m['dtype']}; mean norm {m['mean_norm']:.4g}{dropped})")
