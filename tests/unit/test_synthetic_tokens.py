"""train-synthetic stores the token ids of the analysed sequences (``analysis_tokens``), the ones behind
every fit, dimension and stored activation."""

from __future__ import annotations

import numpy as np

from actlake.config import parse_config
from actlake.jobs.train.synthetic.analyze import TABLES, analysis_data, token_rows
from actlake.jobs.train.synthetic.config import SyntheticConfig
from actlake.jobs.train.synthetic.loop import build_process


def test_token_rows_are_the_analysed_sequences():
    cfg = parse_config({"name": "t", "process": {"factors": [{"kind": "mess3"}, {"kind": "mess3"}]},
                        "model": {"context": 6}, "analysis": {"sequences": 20, "vary_one_sequences": 5}},
                       root=SyntheticConfig)
    process = build_process(cfg.process, 0.0)
    data = analysis_data(process, cfg)
    rows = token_rows(data)
    assert "analysis_tokens" in TABLES
    sampled = np.array([r["tokens"] for r in rows if r["sequence_set"] == "sampled"])
    np.testing.assert_array_equal(sampled, data["tokens"])  # (20, 6), in sequence order
    assert [r["sequence"] for r in rows if r["sequence_set"] == "sampled"] == list(range(20))
    for i in range(2):
        vary = np.array([r["tokens"] for r in rows if r["sequence_set"] == f"vary{i}"])
        np.testing.assert_array_equal(vary, data["vary_one"][i])
    again = token_rows(analysis_data(process, cfg))  # the same seed gives the same sequences
    assert again == rows
    assert all(type(t) is int for r in rows for t in r["tokens"])
