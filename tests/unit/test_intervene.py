"""The residual-stream edits of ``interventions:`` (analysis/engine/intervene.py) against numpy written out."""

from __future__ import annotations

import numpy as np
import torch

from actlake.analysis.engine.intervene import Intervention

rng = np.random.default_rng(3)
H = rng.normal(size=(2, 5, 8)) * 3.0  # (B, T, d)
U = rng.normal(size=8)
VALID = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], bool)
ROLE = np.array([[0, 4, 2, 4, 0], [0, 4, 4, 3, 1]])  # bos other period other (pad) / bos other other comma eos


def _edit(**spec):
    iv = Intervention("x", (1,), **spec)
    select = iv.selected(torch.tensor(VALID), torch.tensor(ROLE))
    return iv.edit(1, torch.tensor(H), select).numpy(), select.numpy()


def test_direction_ops_change_only_the_component_along_it_on_selected_tokens():
    u = U / np.linalg.norm(U)
    c = H @ u  # (B, T)
    for op, value, new in [("project_out", 0.0, 0 * c), ("zero", 0.0, 0 * c), ("scale", -1.5, -1.5 * c),
                           ("add", 2.0, c + 2.0)]:
        out, sel = _edit(op=op, direction=tuple(u), value=value)
        want = np.where(sel[..., None], H + (new - c)[..., None] * u, H)
        assert np.allclose(out, want, rtol=0, atol=1e-12), op
        assert np.allclose(out @ u, np.where(sel, new, c), atol=1e-12), op


def test_dims_ops_roles_and_positions_select_the_tokens():
    out, sel = _edit(op="scale", dims=(1, 6), value=0.5, tokens="other", positions=(1, 2))
    assert sel.tolist() == [[False, True, False, False, False], [False, True, True, False, False]]
    want = H.copy()
    want[..., [1, 6]] = np.where(sel[..., None], 0.5 * H[..., [1, 6]], H[..., [1, 6]])
    assert np.array_equal(out, want)
    out, sel = _edit(op="mean", dims=(0, 2), means=((4.0, -1.0),), tokens="bos")
    assert sel[:, 0].all() and sel.sum() == 2
    assert np.array_equal(out[:, 0, [0, 2]], [[4.0, -1.0], [4.0, -1.0]]) and np.array_equal(out[:, 1:], H[:, 1:])
    out, sel = _edit(op="zero", dims=(3,))
    assert sel.tolist() == VALID.tolist()  # padding is never edited
    assert (out[..., 3][VALID] == 0).all() and out[0, 4, 3] == H[0, 4, 3]


def test_the_config_names_every_token_role():
    import typing

    from actlake.categories import ROLE
    from actlake.config import InterventionConfig

    assert typing.get_args(InterventionConfig.model_fields["tokens"].annotation) == ("all", *ROLE)


def test_a_run_json_whose_interventions_are_not_names_is_refused_by_sql():
    """``actlake sql`` builds each pass's SELECTs from run.json's intervention names: a run folder written by hand
    (a name with a quote, a number, a duplicate, 'none') is refused naming the file, never put into SQL."""
    from types import SimpleNamespace

    import pytest

    from actlake.errors import StorageError
    from actlake.storage.sql import _passes

    layout = SimpleNamespace(run_json="runs/x/run.json")
    assert _passes(layout, None) == [] and _passes(layout, [{"name": "zero_99"}]) == ["none", "zero_99"]
    for bad in ([{"name": "x'); DROP TABLE t; --"}], [{"name": 3}], [{"name": "a"}, {"name": "a"}], [{"name": "none"}],
                "zero", [["name", "a"]]):
        with pytest.raises(StorageError, match="runs/x/run.json: its config's interventions are not a list"):
            _passes(layout, bad)
