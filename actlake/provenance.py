"""What a run's results depend on besides its config: the corpus's content and the libraries' versions."""

from __future__ import annotations

import hashlib
import platform
from importlib import metadata

LIBRARIES = ("actlake", "torch", "transformers", "tokenizers")


def versions() -> dict[str, str | None]:
    """Installed versions of actlake and the libraries its numbers depend on, and Python's (None: not installed)."""
    out: dict[str, str | None] = {}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out | {"python": platform.python_version()}


def corpus_fingerprint(inputs: dict[str, dict]) -> str | None:
    """One sha256 over the content hashes of a run's inputs (``path -> fingerprint``): the same corpus gives the
    same value wherever its files live."""
    if not inputs:
        return None
    hashes = sorted(str(fp.get("hash")) for fp in inputs.values())
    return hashlib.sha256("\n".join(hashes).encode()).hexdigest()


def provenance(inputs: dict[str, dict] | None) -> dict:
    """``{"corpus_fingerprint", "versions"}`` for a run's summary."""
    return {"corpus_fingerprint": corpus_fingerprint(inputs or {}), "versions": versions()}
