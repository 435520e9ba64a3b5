"""Peak resident memory of loading a Pythia-1.4B-shaped model on the CPU, per loading method.

    .venv/bin/python benchmarks/load_memory.py --folder /tmp/pythia-1.4b-random [--save-dtype float16] [--dtype bfloat16]

Saves (once per folder) a randomly initialised GPT-NeoX with Pythia-1.4B's configuration (24 layers,
d = 2048, 16 heads, MLP 8192, vocabulary 50,304; 1.41e9 parameters) in ``--save-dtype`` as
safetensors (the hub's Pythia checkpoints are float16), then loads it in ``--dtype`` in a fresh
process per method and reports that process's peak resident set (``ru_maxrss``) and resident set
after loading, then after one forward pass of 64 tokens (which touches every weight: a
checkpoint loaded in its own dtype stays memory-mapped until then), against the weights' bytes.
It also samples the anonymous part of the resident set (``RssAnon``: heap and tensors, every 5 ms)
for its peak, and reports anonymous and file-backed memory at the end: the file-backed part is the
checkpoint's memory-mapped pages, clean page cache the kernel drops under pressure. Methods:

- ``from_pretrained``: ``AutoModelForCausalLM.from_pretrained(folder, dtype=...)`` then ``.to("cpu")``,
  the path actlake took before (no device_map);
- ``device_map``: the same with ``device_map={"": DEVICE}`` (each weight goes to ``--device`` as it is read);
- ``actlake``: :func:`actlake.model.load_model` as a worker calls it (``model.dtype`` = ``--dtype``,
  ``model.device`` = ``--device``, LM head included);
- ``actlake_auto``: the same with ``model.dtype: auto`` (float32 on a CPU: a bfloat16 checkpoint is
  widened, so about twice the weights' bytes is expected).

Results as JSON lines on stdout (and ``--out``).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

PYTHIA_1_4B = dict(vocab_size=50304, hidden_size=2048, num_hidden_layers=24, num_attention_heads=16,
                   intermediate_size=8192, max_position_embeddings=2048, rotary_pct=0.25, use_parallel_residual=True,
                   tie_word_embeddings=False)
METHODS = ("from_pretrained", "device_map", "actlake", "actlake_auto")


def save_model(folder: Path, dtype: str) -> None:
    """A random Pythia-1.4B-shaped GPT-NeoX and a small tokenizer, saved with save_pretrained (once)."""
    import torch
    from transformers import AutoModelForCausalLM, GPTNeoXConfig

    if (folder / "config.json").exists():
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.conftest import _bpe_tokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GPTNeoXConfig(**PYTHIA_1_4B), dtype=getattr(torch, dtype))
    model.save_pretrained(folder)
    _bpe_tokenizer(folder, bos_prefix=False)


def rss_kinds() -> dict:
    """This process's resident memory now, by kind (bytes): anonymous (heap, tensors) and file-backed
    (memory-mapped checkpoint pages: clean page cache the kernel can drop under pressure)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("RssAnon", "RssFile"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


class AnonPeak:
    """Samples RssAnon every 5 ms in a thread; ``peak`` is the largest seen."""

    def __init__(self):
        import threading

        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_kinds().get("RssAnon", 0))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, rss_kinds().get("RssAnon", 0))


def load_once(folder: str, method: str, dtype: str, device: str = "cpu") -> dict:
    """Load the model one way in this process; peak and current RSS against the weights' bytes."""
    import psutil
    import torch

    anon = AnonPeak()

    if method.startswith("actlake"):
        from actlake.config import ModelConfig
        from actlake.model import load_model

        lm = load_model(ModelConfig(name_or_path=folder, dtype="auto" if method == "actlake_auto" else dtype, device=device),
                        lm_head=True)
        model = lm.model
        params = {id(p): p for p in list(model.parameters()) + list(lm.lm_head.parameters())}.values()
    else:
        from transformers import AutoModelForCausalLM

        kw = {"device_map": {"": device}} if method == "device_map" else {}
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype), **kw)
        if not kw:
            model.to(device)
        params = list(model.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rss = psutil.Process().memory_info().rss
    with torch.inference_mode():
        model(input_ids=torch.arange(64, device=device)[None] + 5)
    peak_fwd = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peak_anon, now = anon.stop(), rss_kinds()
    gpu = torch.cuda.max_memory_allocated() / 1e9 if device != "cpu" else 0.0
    return {"method": method, "device": device, "gpu_peak_gb": round(gpu, 3), "dtype": str(next(iter(params)).dtype), "weights_gb": round(weights / 1e9, 3),
            "peak_load_gb": round(peak / 1e9, 3), "rss_after_load_gb": round(rss / 1e9, 3),
            "peak_with_forward_gb": round(peak_fwd / 1e9, 3),
            "rss_after_forward_gb": round(psutil.Process().memory_info().rss / 1e9, 3),
            "peak_over_weights": round(peak_fwd / weights, 3), "peak_anon_gb": round(peak_anon / 1e9, 3),
            "peak_anon_over_weights": round(peak_anon / weights, 3), "anon_after_gb": round(now["RssAnon"] / 1e9, 3),
            "file_after_gb": round(now["RssFile"] / 1e9, 3)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--folder", required=True)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="loading dtype")
    p.add_argument("--save-dtype", default="float16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--out")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(load_once(args.folder, args.child, args.dtype, args.device)), flush=True)
        return
    save_model(Path(args.folder), args.save_dtype)
    lines = []
    for method in args.methods.split(","):
        out = subprocess.run([sys.executable, __file__, "--folder", args.folder, "--dtype", args.dtype, "--device", args.device,
                              "--child", method],
                             check=True, capture_output=True, text=True).stdout
        lines.append(out.strip().splitlines()[-1])
        print(lines[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
