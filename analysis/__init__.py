"""Every table of an extraction job: the producers (analyses and shard tables) behind one protocol
(:mod:`~actlake.analysis.protocol`), the engine they read from (:mod:`~actlake.analysis.engine`) and the
registry of the built-in ones (:mod:`~actlake.analysis.registry`)."""

import importlib
import importlib.abc
import importlib.util
import sys

from actlake.deprecation import deprecated

MOVED = {name: f"actlake.analysis.engine.{name}" for name in (
    "attention_weights", "capture", "device", "grid", "kernels", "layer_qk", "layer_replay", "moments", "recorder",
    "rope", "surprisal")}
"""Modules of 0.1.0 under ``actlake.analysis`` that moved into ``actlake.analysis.engine``: the old names import the
new modules with a DeprecationWarning (CHANGELOG.md), and go in the release after."""


_SPECS: dict = {}
"""Each moved module's own spec, by its name (keyed: two threads importing two old names do not mix them)."""


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import actlake.analysis.grid`` gives ``actlake.analysis.engine.grid`` itself, warning once per import."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, old = fullname.rpartition(".")
        if package == __name__ and old in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        new = MOVED[spec.name.rpartition(".")[2]]
        deprecated(f"{spec.name} moved to {new}; the old name goes in the release after 0.2.0")
        module = importlib.import_module(new)
        _SPECS[new] = module.__spec__  # the import system sets the alias's spec on it next: the module's own, kept
        return module

    def exec_module(self, module):
        module.__spec__ = _SPECS[module.__name__]


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())
