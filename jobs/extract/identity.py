"""What a run's statistics depend on besides its config and corpus: the model's files and the code that computes
them. A run records it in ``run.json`` when it begins; a resume (or a rerun of a finished run, or of a sweep's
checkpoint) with other weights or other code is refused by name, so no run merges two models or two code versions.

- **model**: each file of a local model folder that ``from_pretrained`` reads (weights, configs, vocabularies, remote
  code), by size and a SHA-256 of all of its bytes, computed once per version of the file (cached by its size,
  modification and change times); a hub model by name, revision and the commit its cached snapshot holds.
- **code**: a SHA-256 over actlake's own sources (each ``.py`` file of the package once, under its module path) and
  its version, and one over each custom analysis's code (the files shipped to the workers, or the installed module's).
- **interventions**: a SHA-256 of the interventions' resolved values (a direction file's vector, a ``mean_from``
  run's means); each worker checks its own reading against it (:func:`check_interventions`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import re
from pathlib import Path

from actlake.config import JobConfig, looks_local, resolve_model_path
from actlake.errors import ActlakeError, StorageError
from actlake.fs import write_atomic
from actlake.hashing import file_sha256

MODEL_FILES = re.compile(r"(.*\.safetensors|pytorch_model.*\.bin|tf_model.*\.h5|flax_model.*\.msgpack|.*\.json|.*\.model"
                         r"|.*\.txt|.*\.tiktoken|.*\.py)")
"""Files of a model folder its numbers depend on: weights, configs, vocabularies, remote code (``trust_remote_code``)."""
PACKAGES = ("actlake", "actlake.jobs", "actlake.analysis", "actlake.storage")


def _sources_sha(files: list[tuple[str, Path]]) -> str:
    """SHA-256 over ``(name, file)`` pairs: each name and the file's bytes, in name order."""
    h = hashlib.sha256()
    for name, p in sorted(files):
        h.update(name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _py_files(folder: Path, skip=()) -> list[tuple[str, Path]]:
    return [(p.relative_to(folder).as_posix(), p) for p in folder.rglob("*.py")
            if "__pycache__" not in p.parts and p.relative_to(folder).parts[0] not in skip]


def actlake_code() -> dict:
    """actlake's version and the hash of its sources, each file once under its module path (the same for an
    editable install, a wheel and the copy ``actlake submit`` ships)."""
    from actlake import __version__

    files = []
    for pkg in PACKAGES:
        folder = Path(list(importlib.import_module(pkg).__path__)[0])
        skip = ("jobs", "analysis", "storage") if pkg == "actlake" else ()  # nested in a wheel: hashed as their own
        files += [(f"{pkg}/{name}", p) for name, p in _py_files(folder, skip)]
    return {"version": __version__, "sha256": _sources_sha(files)}


def custom_code_sha(cfg: JobConfig, shipped: dict[str, bytes]) -> dict[str, str]:
    """``{'module:attr': sha256}`` of your code (each custom analysis, each custom intervention's function): the files
    shipped to the workers for one with a ``path``, the installed module's package (or file) for one without."""
    out = {}
    for key, ref, path in cfg.code_refs:
        target = ref if key[0] == "analyses" else f"intervention function {ref}"
        module = ref.split(":")[0]
        if path:
            top = Path(path).name
            h = hashlib.sha256()
            for rel in sorted(r for r in shipped if r == top or r.startswith(top + "/")):
                h.update(rel.encode() + b"\0" + shipped[rel] + b"\0")
            out[target] = h.hexdigest()
            continue
        spec = importlib.util.find_spec(module.split(".")[0])
        if spec is None or spec.origin is None and not spec.submodule_search_locations:
            raise ActlakeError(f"{'.'.join(k for k in key if isinstance(k, str))}: {ref}: module '{module}' is not "
                               "importable")
        where = list(spec.submodule_search_locations or [])
        out[target] = _sources_sha(_py_files(Path(where[0]))) if where else \
            hashlib.sha256(Path(spec.origin).read_bytes()).hexdigest()
    return out


def _hash_cache() -> Path:
    from actlake.storage.verified import cache_dir

    return cache_dir() / "model-hashes.json"


def _content_sha(p: Path, cache: dict) -> str:
    """SHA-256 of the file's bytes, from ``cache`` when its size, modification and change times are as recorded."""
    st = p.stat()
    key, stamp = str(p.resolve()), [st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    hit = cache.get(key)
    if isinstance(hit, list) and len(hit) == 2 and hit[0] == stamp:
        return hit[1]
    digest = file_sha256(p)
    cache[key] = [stamp, digest]
    return digest


def model_files(cfg: JobConfig) -> dict:
    """``{"files": {name: {"size", "sha256"}}}`` of a local model folder's top-level files that ``from_pretrained``
    reads, or ``{"hub", "revision", "commit"}`` of a hub model (commit: its cached snapshot's; None if not cached)."""
    name = cfg.model.name_or_path
    if not (looks_local(name) or name.startswith("package:")):
        try:
            from huggingface_hub import snapshot_download

            commit = Path(snapshot_download(name, revision=cfg.model.revision, local_files_only=True)).name
        except Exception:  # noqa: BLE001 - not in the cache (a cluster whose workers download): name and revision
            commit = None
        return {"hub": name, "revision": cfg.model.revision, "commit": commit}
    folder = Path(resolve_model_path(name))
    try:
        cache = json.loads(_hash_cache().read_text())
        cache = cache if isinstance(cache, dict) else {}
    except (OSError, ValueError):
        cache = {}
    files = {}
    # not only regular files: a FIFO or device named like a model file is refused by name (file_sha256), never skipped
    for p in sorted(p for p in folder.iterdir() if p.exists() and not p.is_dir() and MODEL_FILES.fullmatch(p.name)):
        try:
            files[p.name] = {"size": p.stat().st_size, "sha256": _content_sha(p, cache)}
        except OSError as e:
            raise StorageError(f"model.name_or_path: {p}: cannot read the model file ({e.strerror or e})") from None
    try:
        write_atomic(_hash_cache(), json.dumps(cache).encode())
    except OSError:  # a read-only home: hashed again next time
        pass
    return {"files": files}


def interventions_sha(interventions: tuple) -> str | None:
    """A SHA-256 of resolved interventions (their directions' and means' values too), or None without any."""
    return hashlib.sha256(repr(tuple(interventions)).encode()).hexdigest() if interventions else None


def run_identity(cfg: JobConfig, shipped: dict[str, bytes], interventions: tuple | None = None) -> dict:
    """The run's identity to record in run.json: model files, actlake's code, the custom analyses' code, and the
    values of the interventions' directions and means (files the config names only by path): ``interventions``
    resolved already, or None to resolve them here."""
    out = {"model": model_files(cfg), "code": actlake_code(), "custom": custom_code_sha(cfg, shipped)}
    if interventions:
        out["interventions"] = interventions_sha(interventions)
    elif cfg.interventions:
        from actlake.architectures import read_model_config
        from actlake.jobs.extract.interventions import resolve_interventions

        m = cfg.model
        config = read_model_config(resolve_model_path(m.name_or_path), m.revision, m.trust_remote_code)
        out["interventions"] = interventions_sha(resolve_interventions(cfg, config))
    return out


def identity_change(old: dict, new: dict) -> str | None:
    """What differs between a run's recorded identity and this job's, in a few words; None if it is the same."""
    om, nm = old.get("model", {}), new["model"]
    if ("files" in om) != ("files" in nm) or om.get("hub") != nm.get("hub") or om.get("revision") != nm.get("revision"):
        return f"the model is {_model_name(nm)} now, {_model_name(om)} when the run began"
    if om.get("commit") and nm.get("commit") and om["commit"] != nm["commit"]:
        return f"the model {nm['hub']} is at commit {nm['commit'][:12]} now, {om['commit'][:12]} when the run began"
    of, nf = om.get("files", {}), nm.get("files", {})
    for rel in sorted(set(of) | set(nf)):
        if rel not in nf:
            return f"model file {rel} is gone"
        if rel not in of:
            return f"model file {rel} is new"
        if of[rel] != nf[rel]:
            return f"model file {rel}: content changed"
    oc, nc = old.get("code", {}), new["code"]
    if oc.get("sha256") != nc["sha256"]:
        versions = f"{oc.get('version')} then, {nc['version']} now" if oc.get("version") != nc["version"] else \
            f"version {nc['version']} both times, different sources"
        return f"actlake's code changed ({versions})"
    if old.get("interventions") != new.get("interventions"):
        return "an intervention's direction file or mean_from run changed"
    ou, nu = old.get("custom", {}), new["custom"]
    for name in sorted(set(ou) | set(nu)):
        if ou.get(name) != nu.get(name):
            what = name if name.startswith("intervention function") else f"custom analysis {name}"
            return f"{what}'s code changed" if name in ou and name in nu else \
                f"{what} {'added' if name in nu else 'removed'}"
    return None


def _model_name(m: dict) -> str:
    return f"{m['hub']}@{m.get('revision') or 'main'} (from the hub)" if "hub" in m else "a local folder"


def check_interventions(layout, interventions: tuple) -> None:
    """A worker's resolved interventions against the run's record: a direction file or ``mean_from`` run changed
    since the run began would mix two edits in one table (ConfigError, the same on every retry)."""
    from actlake.errors import ConfigError
    from actlake.storage.manifest import read_run

    recorded = (read_run(layout).get("identity") or {}).get("interventions")
    if recorded != interventions_sha(interventions):
        raise ConfigError(f"interventions: a direction file or mean_from run reads differently here than when run "
                          f"'{layout.root.name}' began; its results would mix two edits: pick a new output.run_id")
