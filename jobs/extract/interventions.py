"""A job's ``interventions:`` checked against its model and resolved into the engine's plain
:class:`~actlake.analysis.engine.intervene.Intervention` values: the driver does it before Ray starts (a bad
spec is one line naming the key), each worker again when it loads the model (the same files, read where it runs,
as the corpus is)."""

from __future__ import annotations

import numpy as np

from actlake.analysis.engine.intervene import Intervention, load_function
from actlake.architectures import layers_of, text_config
from actlake.config import JobConfig
from actlake.errors import ConfigError
from actlake.fs import location, read_regular


def resolve_interventions(cfg: JobConfig, model_config) -> tuple[Intervention, ...]:
    """Every intervention of ``cfg`` for a model of ``model_config`` (its width and its layers as the engine counts
    them, :func:`~actlake.architectures.layers_of`); ConfigError naming ``interventions[i].<key>`` where it does not
    fit."""
    text = text_config(model_config)  # a multimodal model's: its text model's
    width, depth = text.hidden_size, layers_of(model_config)
    out = []
    for i, iv in enumerate(cfg.interventions):
        key = f"interventions[{i}] ({iv.name})"
        layers = tuple(iv.at if isinstance(iv.at, list) else [iv.at])
        if max(layers) >= depth:
            raise ConfigError(f"{key}.at: hidden state {max(layers)} is not the input of a block; the model has "
                              f"{depth} blocks (hidden states 0-{depth - 1} can be edited)")
        if iv.dims and max(iv.dims) >= width:
            raise ConfigError(f"{key}.dims: dimension {max(iv.dims)} is beyond the model's width ({width})")
        direction = _direction(key, iv.direction, width) if iv.direction is not None else None
        means = _means(key, cfg, iv, layers) if iv.op == "mean" else None
        if iv.function is not None:
            load_function(iv.function)  # importable and callable here (the driver: before Ray; a worker: at load)
        out.append(Intervention(iv.name, layers, iv.op, tuple(iv.dims), direction, iv.value or 0.0, means, iv.tokens,
                                tuple(iv.positions), iv.function))
    return tuple(out)


def _direction(key: str, path, width: int) -> tuple[float, ...]:
    """The unit vector a ``.npy`` file holds."""
    import io

    try:
        v = np.load(io.BytesIO(read_regular(path)), allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}.direction: {path}: not a readable .npy array ({e})") from None
    if v.shape != (width,) or not np.issubdtype(v.dtype, np.floating) or not np.isfinite(v).all() or not v.any():
        raise ConfigError(f"{key}.direction: {path}: expected one finite, non-zero float vector of the model's width "
                          f"({width}), got shape {v.shape} of {v.dtype}")
    return tuple(float(x) for x in v / np.linalg.norm(v))


def _means(key: str, cfg: JobConfig, iv, layers: tuple[int, ...]) -> tuple[tuple[float, ...], ...]:
    """Each edited dimension's mean at each edited hidden state, from ``mean_from``'s ``dim_moments`` (clean pass,
    every document), over the category of the edited tokens (a role's, else every token's)."""
    from actlake.errors import StorageError
    from actlake.jobs.extract.identity import model_files
    from actlake.storage.layout import RunLayout
    from actlake.storage.manifest import read_run
    from actlake.storage.sql import query

    try:
        run = read_run(RunLayout(location(iv.mean_from)))
    except (StorageError, OSError) as e:
        raise ConfigError(f"{key}.mean_from: {iv.mean_from}: not a run folder ({e})") from None
    theirs, ours = (run.get("identity") or {}).get("model"), model_files(cfg)
    if theirs != ours:
        raise ConfigError(f"{key}.mean_from: {iv.mean_from} is a run of another model (its model files differ from "
                          f"{cfg.model.name_or_path}'s): means of one model's residual stream mean nothing in another's")
    scheme, category = ("role", iv.tokens) if iv.tokens != "all" else ("all", "all")
    try:
        rows = query(str(iv.mean_from), f"SELECT layer, dim, mean FROM dim_moments WHERE source = '*' AND "
                                        f"scheme = '{scheme}' AND category = '{category}' AND count > 0").to_pydict()
    except Exception as e:  # noqa: BLE001 - no dim_moments, or not reduced: one line naming the key
        raise ConfigError(f"{key}.mean_from: {iv.mean_from}: cannot read its dim_moments ({e})") from None
    found = {(la, d): m for la, d, m in zip(rows["layer"], rows["dim"], rows["mean"])}
    missing = [(la, d) for la in layers for d in iv.dims if (la, d) not in found]
    if missing:
        raise ConfigError(f"{key}.mean_from: {iv.mean_from}'s dim_moments has no mean for (layer, dim) {missing[:4]} "
                          f"over {scheme} = {category}")
    return tuple(tuple(found[(la, d)] for d in iv.dims) for la in layers)
