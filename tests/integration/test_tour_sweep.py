"""The README tour's last block, as printed: train-lm keeps seven snapshots, a checkpoint sweep runs every
analysis under each, then a sweep query and the quick start's run side by side with the last snapshot."""

from __future__ import annotations

import re
import shutil

import pytest
import yaml

from actlake.corpus.sample import write_sample
from actlake.storage.sql import query
from tests.documented import ROOT, command, new_shell

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_the_tour_s_sweep_and_runs_side_by_side(tmp_path):
    """The tour's last block as printed, in a folder of its own (a reader's runs/lm-quick stays as it is), with the
    train-lm config scaled down to a tiny LM (the same steps, so the same snapshots the sweep config names) and a
    48-document sample; the side-by-side query reads the default job's run on that sample (as runs/quickstart).
    Independent of the quick start's run, so that it runs beside it in the other test process."""
    write_sample(tmp_path / "data" / "sample", n_docs=48, n_files=2)
    (tmp_path / "configs").mkdir()
    shutil.copy(ROOT / "configs" / "lm_quick_sweep.yaml", tmp_path / "configs")
    lm = yaml.safe_load((ROOT / "configs" / "lm_quick.yaml").read_text())
    lm["tokenizer"]["vocab_size"] = 300
    lm["model"] = {"hidden_size": 16, "num_layers": 2, "num_heads": 2, "intermediate_size": 32}
    lm["training"].update(batch_size=2, seq_len=16, warmup_steps=5, eval_every=400, checkpoint_every=400)
    lm["resources"]["cpus_per_worker"] = 1
    (tmp_path / "lm_tiny.yaml").write_text(yaml.safe_dump(lm))
    activate = f"source {ROOT}/.venv/bin/activate\n"
    new_shell(activate + f"actlake run {ROOT}/actlake/default.yaml --no-report", cwd=tmp_path)  # runs/quickstart
    out = new_shell(activate + command("tour-sweep").replace("configs/lm_quick.yaml", "lm_tiny.yaml"), cwd=tmp_path).stdout
    assert "train-lm: 7 snapshots" in out and "(every one's weights differ)" in out
    (table,) = [t for t in out.split("┌") if re.search(r"│\s*layer\s*│\s*step\s*│\s*mass_on_first", t)]
    sweep = {(int(a), int(b)) for a, b in re.findall(r"^│\s*(\d+)\s*│\s*(\d+)\s*│\s*[\d.]+\s*│$", table, re.M)}
    assert sweep == {(layer, step) for layer in (0, 1) for step in (0, 2, 8, 27, 85, 262, 800)}, out
    side = re.findall(r"^│\s*(quickstart|step-800)\s*│\s*(\d+)\s*│\s*([\d.]+)\s*│$", out, re.M)
    assert sorted((run, int(layer)) for run, layer, _ in side) == sorted(
        [("quickstart", layer) for layer in range(6)] + [("step-800", layer) for layer in range(2)]), out
    own = query(tmp_path / "runs" / "quickstart", "SELECT layer, round(avg(mean_mass), 3) AS m FROM attention_mass_by_key "
                "WHERE key_category = 'bos' GROUP BY ALL").to_pylist()
    assert {(int(la), float(m)) for run, la, m in side if run == "quickstart"} == {(r["layer"], r["m"]) for r in own}
    tokens = query(tmp_path / "runs" / "lm-quick-sweep" / "checkpoints" / "step-800",
                   "SELECT count(*) FILTER (WHERE role = 'bos') AS bos, count(*) FILTER (WHERE role = 'bos' AND position = 0) "
                   "AS first, count(DISTINCT (doc_id, window_index)) AS windows FROM tokens").to_pylist()[0]
    assert tokens["bos"] == tokens["first"] == tokens["windows"] > 0  # prepend_bos: the BOS first in every window
