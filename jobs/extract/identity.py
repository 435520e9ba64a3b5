"""What a run's statistics depend on besides its config and corpus: the model's files and the code that computes
them. A run records it in ``run.json`` when it begins; a resume (or a rerun of a finished run, or of a sweep's
checkpoint) with other weights or other code is refused by name, so no run merges two models or two code versions.

- **model**: each weight and config file of a local model folder (or a hub model's cached snapshot) by size,
  modification time and content hash (:func:`actlake.corpus.fingerprint.file_fingerprint`: whole up to 64 MiB,
  sampled blocks plus the change time above); a hub model not in the local cache by name and revision.
- **code**: a SHA-256 over actlake's own sources (every ``.py`` file of the package as installed) and its
  version, and one over each custom analysis's code (the files shipped to the workers, or the installed module's).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import re
from pathlib import Path

from actlake.config import JobConfig, looks_local, resolve_model_path
from actlake.corpus.fingerprint import describe_change, file_fingerprint
from actlake.errors import ActlakeError, StorageError

MODEL_FILES = re.compile(r"(.*\.safetensors|pytorch_model.*\.bin|tf_model.*\.h5|flax_model.*\.msgpack|.*\.json|.*\.model|.*\.txt|.*\.tiktoken)")
"""Files of a model folder its numbers depend on: weights, configs (model, generation, tokenizer), vocabularies."""
PACKAGES = ("actlake", "actlake.jobs", "actlake.analysis", "actlake.storage")


def _sources_sha(folders) -> str:
    """SHA-256 over the ``.py`` files under ``folders`` (relative path and bytes, in path order)."""
    h = hashlib.sha256()
    for folder in folders:
        root = Path(folder)
        for p in sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts):
            h.update(p.relative_to(root.parent).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def actlake_code() -> dict:
    """actlake's version and the hash of its sources as installed (an editable install: the working tree)."""
    from actlake import __version__

    folders = [list(importlib.import_module(p).__path__)[0] for p in PACKAGES]
    return {"version": __version__, "sha256": _sources_sha(folders)}


def custom_code_sha(cfg: JobConfig, shipped: dict[str, bytes]) -> dict[str, str]:
    """``{analysis class: sha256}`` of each custom analysis's code: the files shipped to the workers for one with a
    ``path``, the installed module's package (or file) for one without."""
    out = {}
    for c in cfg.analyses.custom:
        module = c.analysis.split(":")[0]
        if c.path:
            top = Path(c.path).name
            h = hashlib.sha256()
            for rel in sorted(r for r in shipped if r == top or r.startswith(top + "/")):
                h.update(rel.encode() + b"\0" + shipped[rel] + b"\0")
            out[c.analysis] = h.hexdigest()
            continue
        spec = importlib.util.find_spec(module.split(".")[0])
        if spec is None or spec.origin is None and not spec.submodule_search_locations:
            raise ActlakeError(f"analyses.custom: {c.analysis}: module '{module}' is not importable")
        where = list(spec.submodule_search_locations or [])
        out[c.analysis] = _sources_sha(where) if where else hashlib.sha256(Path(spec.origin).read_bytes()).hexdigest()
    return out


def model_files(cfg: JobConfig) -> dict:
    """``{"files": {relative path: fingerprint}}`` of the model's folder, or ``{"hub": name, "revision": r}``."""
    name = cfg.model.name_or_path
    if looks_local(name) or name.startswith("package:"):
        folder = Path(resolve_model_path(name))
    else:
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(name, revision=cfg.model.revision, local_files_only=True))
        except Exception:  # noqa: BLE001 - not in the cache (a cluster whose workers download): name and revision
            return {"hub": name, "revision": cfg.model.revision}
    files = {}
    for p in sorted(p for p in folder.rglob("*") if p.is_file() and MODEL_FILES.fullmatch(p.name)):
        try:
            fp = file_fingerprint(str(p))
        except ActlakeError as e:
            raise StorageError(f"model.name_or_path: {p}: cannot fingerprint the model file ({e})") from None
        files[p.relative_to(folder).as_posix()] = fp
    return {"files": files}


def run_identity(cfg: JobConfig, shipped: dict[str, bytes]) -> dict:
    """The run's identity to record in run.json: model files, actlake's code, the custom analyses' code."""
    return {"model": model_files(cfg), "code": actlake_code(), "custom": custom_code_sha(cfg, shipped)}


def identity_change(old: dict, new: dict) -> str | None:
    """What differs between a run's recorded identity and this job's, in a few words; None if it is the same."""
    om, nm = old.get("model", {}), new["model"]
    if ("files" in om) != ("files" in nm) or om.get("hub") != nm.get("hub") or om.get("revision") != nm.get("revision"):
        return f"the model is {_model_name(nm)} now, {_model_name(om)} when the run began"
    of, nf = om.get("files", {}), nm.get("files", {})
    for rel in sorted(set(of) | set(nf)):
        if rel not in nf:
            return f"model file {rel} is gone"
        if rel not in of:
            return f"model file {rel} is new"
        why = describe_change(of[rel], nf[rel])
        if why:
            return f"model file {rel}: {why}"
    oc, nc = old.get("code", {}), new["code"]
    if oc.get("sha256") != nc["sha256"]:
        versions = f"{oc.get('version')} then, {nc['version']} now" if oc.get("version") != nc["version"] else \
            f"version {nc['version']} both times, different sources"
        return f"actlake's code changed ({versions})"
    ou, nu = old.get("custom", {}), new["custom"]
    for name in sorted(set(ou) | set(nu)):
        if ou.get(name) != nu.get(name):
            return f"custom analysis {name}'s code changed" if name in ou and name in nu else \
                f"custom analysis {name} {'added' if name in nu else 'removed'}"
    return None


def _model_name(m: dict) -> str:
    return f"{m['hub']}@{m.get('revision') or 'main'} (from the hub)" if "hub" in m else "a local folder"
