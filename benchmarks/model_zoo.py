"""The model zoo: a tiny random model of every causal-LM and masked-LM model type of the installed transformers
(tests/zoo_models.py: scaled down, knobs away from their defaults), its default analyses in process against float64
eager transformers (tests/zoo_check.py), one row per type: ok / refused (reason) / wrong (quantity, error) / caught
(the first-batch self-check stops it) / not built (the tiny config could not be made).

    .venv/bin/python benchmarks/model_zoo.py                 # every type, a table on stdout
    .venv/bin/python benchmarks/model_zoo.py --markdown docs/models.md
    .venv/bin/python benchmarks/model_zoo.py llama qwen3     # some types
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

EXACT = 1e-5
MEMORY = 8 << 30
"""Address space of the child that builds and runs one type (bytes)."""
TIMEOUT = 120
WINDOW = 24
"""Tokens per window of the comparison (tests/zoo_check.py's batch)."""


def model_types() -> list[tuple[str, str]]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES

    causal = [(t, "causal") for t in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)]
    return causal + [(t, "encoder") for t in sorted(MODEL_FOR_MASKED_LM_MAPPING_NAMES) if t not in dict(causal)]


def one(model_type: str, root: Path) -> tuple[str, str]:
    """(status, detail) of one model type; ``ok*`` / ``caught*``: its family was discovered, not declared."""
    from actlake.architectures import check_chunks, check_config, declared
    from actlake.errors import ModelLoadError
    from tests.zoo_check import compare
    from tests.zoo_models import build, tiny_config

    try:
        config = tiny_config(model_type)
    except Exception as e:  # noqa: BLE001 - any type's config may fail to scale down
        return "not built", f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    try:
        check_config(config)
        check_chunks(config, WINDOW)  # as a job of WINDOW-token windows: what check_model refuses before Ray
    except ModelLoadError as e:
        return "refused", str(e).split(" is not supported: ", 1)[-1][:160]
    try:
        folder = build(model_type, root / model_type)
    except Exception as e:  # noqa: BLE001
        return "not built", f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    try:
        err = compare(str(folder))
    except ModelLoadError as e:  # its config passed check_config: the tiny model itself did not load
        if LOAD_REFUSED in str(e):  # the engine refuses the type's own checkpoint (weights it would leave random)
            return "refused", "at load: " + str(e).split(": ", 1)[-1][:150]
        return "not built", str(e).split(": ", 1)[-1][:160]
    except Exception as e:  # noqa: BLE001 - a crash inside the engine is a finding
        return "error", f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    caught = err.pop("self_check")
    wrong = {k: v for k, v in err.items() if not v <= EXACT}
    star = "" if declared(model_type) else "*"
    if caught:
        return "caught" + star, caught[0][:200]
    if wrong:
        return "wrong" + star, ", ".join(f"{k} {v:.1e}" for k, v in wrong.items())
    alone = "; the decoder alone (no encoder input, no cross-attention)" if check_config(config).decoder_alone else ""
    return "ok" + star, f"largest error {max(err.values()):.1e}{alone}"


LOAD_REFUSED = "weights of its transformer blocks are not in the checkpoint"
"""actlake.architectures.check_loaded's refusal: a job's workers refuse the model when they load it."""


def _limited() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def isolated(model_type: str, root: Path) -> tuple[str, str]:
    """:func:`one` in a forked child with :data:`MEMORY` of address space and :data:`TIMEOUT` seconds: a type whose
    default config is huge or hangs costs a row, not the run."""
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(1, initializer=_limited) as pool:
        try:
            return pool.apply_async(one, (model_type, root)).get(TIMEOUT)
        except multiprocessing.TimeoutError:
            return "not built", f"over {TIMEOUT} s"
        except Exception as e:  # noqa: BLE001 - the child died (memory) or raised outside one()
            return "not built", f"{type(e).__name__}: {str(e)[:120]}"


def main() -> None:
    import transformers

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("types", nargs="*", help="model types (default: every causal LM and masked LM type)")
    p.add_argument("--markdown", help="write the table as a Markdown page here")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    types = [(t, "") for t in args.types] or model_types()
    rows, t0 = [], time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for t, kind in types:
            status, detail = isolated(t, Path(tmp))
            rows.append((t, kind, status, detail))
            print(f"{t:28s} {kind:8s} {status:9s} {detail}", flush=True)
    counts = Counter(r[2] for r in rows)
    exact, judged = share(rows)
    print(f"\n{len(rows)} model types, transformers {transformers.__version__}, {time.time() - t0:.0f} s: "
          + ", ".join(f"{k} {v}" for k, v in counts.most_common())
          + f"; exact {exact} of {judged} with attention through the interface")
    if args.markdown:
        Path(args.markdown).write_text(page(rows, counts, transformers.__version__))


OUTSIDE = ("outside the transformers attention interface", "no attention module was found",
           "no list of transformer blocks was found")
"""Refusals of a type whose attention does not go through the transformers attention interface (or has none)."""


def share(rows) -> tuple[int, int]:
    """(exact, judged) over the types whose attention goes through the interface: every row but those refused for
    :data:`OUTSIDE` and those not built (no verdict)."""
    judged = [r for r in rows if not (r[2] == "refused" and any(o in r[3] for o in OUTSIDE)) and r[2] != "not built"]
    return sum(r[2].startswith("ok") for r in judged), len(judged)


def page(rows, counts, version: str) -> str:
    exact, judged = share(rows)
    body = "\n".join(f"| `{t}` | {kind} | {status} | {detail.replace('|', '/').replace('<', '&lt;').replace('>', '&gt;')} |" for t, kind, status, detail in rows)
    ok = [f"`{t}`" for t, _, s, _ in rows if s == "ok"]
    found = [f"`{t}`" for t, _, s, _ in rows if s == "ok*"]
    return f"""# Supported models

Generated by `benchmarks/model_zoo.py --markdown docs/models.md` with transformers {version}: a tiny random model
of every causal-LM and masked-LM model type, its scaling knobs away from their defaults (softcaps, logit scales,
multipliers, partial rotary), run through the default analyses in process and compared with float64 eager
transformers (residual norms, attention mass by key category, q/k norms, the distance profile, the contributions'
sum rule, surprisal). **ok**: every quantity within {EXACT:g} of the reference (relative to its largest value).
**refused**: `actlake run` refuses it before Ray starts, with the reason (or, "at load", each worker when it
loads the weights: a checkpoint that would leave weights of the blocks random). **caught**: the first-batch self-check
stops the job (nothing written), naming the layer and the analyses. A `*` marks a type with no declaration in
`actlake/architectures.py`, whose layout `actlake/discovery.py` read off its modules (announced when the job
starts; only the self-check vouches for it). **not built**: the tiny model could not be made (a default config
transformers' own validation rejects, or one the zoo's scaling down breaks); no verdict. **error**: the engine failed on
it (a job stops with the error). The tiny config keeps two layers of the full stack, one of each kind where it mixes
kinds (sliding and full attention, recurrent and attention layers), with their per-layer settings. An encoder-decoder
type runs as its decoder alone (the type's causal LM: no encoder input, so no cross-attention; its detail says so, and
so does a job when it starts). Where blocks run several times per forward pass (ALBERT's shared groups, Dory's loops,
HRM's cycles), layer k is the k-th attention call of the pass (call-order layers, METHODS.md §3).
Counts: {", ".join(f"{k} {v}" for k, v in counts.most_common())}. Of the {judged} types whose attention goes
through the transformers attention interface (all but those refused for attention outside it or none, and those not
built), {exact} are exact ({100 * exact / max(judged, 1):.0f} %); the others are refused by name (a feature not
modelled yet) or caught.

Exact, declared: {", ".join(ok)}.

Exact, discovered: {", ".join(found)}.

Larger models of these types run the same code (the families are declared per model type, not per size);
`tests/integration/test_families.py` runs the declared ones in CI.

| model type | kind | status | detail |
|---|---|---|---|
{body}
"""


if __name__ == "__main__":
    main()
