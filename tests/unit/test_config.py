import json
import os

import pytest

from actlake.config import load_config, parse_config, reference_markdown
from actlake.errors import ConfigError
from actlake.jobs.cli import main


def _write(tmp_path, text):
    p = tmp_path / "job.yaml"
    p.write_text(text)
    return p


def test_unknown_key_names_file_key_line_and_suggestion(tmp_path):
    p = _write(tmp_path, "name: x\nmodel:\n  dtyp: float32\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, check_files=False)
    msg = str(e.value)
    assert str(p) in msg and "line 3" in msg and "model.dtyp" in msg and "did you mean 'dtype'" in msg


def test_wrong_type_and_bad_choice(tmp_path):
    with pytest.raises(ConfigError, match=r"line 2.*'tokenization.max_length': expected an integer"):
        load_config(_write(tmp_path, "tokenization:\n  max_length: lots\n"), check_files=False)
    with pytest.raises(ConfigError, match=r"'model.dtype': expected one of"):
        load_config(_write(tmp_path, "model:\n  dtype: float8\n"), check_files=False)
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_write(tmp_path, "model: [\n"), check_files=False)


def test_fused_attention_weights_refuse_analyses_that_need_the_weights(tmp_path):
    from actlake.analysis.registry import check_table_names

    p = _write(tmp_path, "analyses:\n  attention_weights: fused\n")
    with pytest.raises(ConfigError, match=r"analyses.attention_weights: 'fused' .* analyses.contributions needs "
                                          r"\(weighted_qsum\)"):
        check_table_names(load_config(p, check_files=False))
    ok = "analyses:\n  attention_weights: fused\n  contributions: {weighted: false}\n  attention_by_distance: false\n"
    cfg = load_config(_write(tmp_path, ok), check_files=False)
    check_table_names(cfg)
    assert cfg.analyses.attention_weights == "fused"



def test_missing_corpus_file_and_model_folder(tmp_path):
    p = _write(tmp_path, f"corpus:\n  paths: [{tmp_path}/nothing/*.jsonl]\n")
    with pytest.raises(ConfigError, match=r"corpus.paths\[0\]: no file matches"):
        load_config(p)
    (tmp_path / "c.jsonl").write_text('{"text": "hi"}\n')
    p = _write(tmp_path, f"corpus:\n  paths: [{tmp_path}/c.jsonl]\nmodel:\n  name_or_path: {tmp_path}/no-model\n")
    with pytest.raises(ConfigError, match="model folder not found"):
        load_config(p)


def test_defaults_parse_and_run_id_is_stable():
    a = parse_config({"name": "x"})
    b = parse_config({"name": "x"})
    c = parse_config({"name": "x", "tokenization": {"max_length": 64}})
    assert a.run_id == b.run_id != c.run_id
    assert parse_config({"output": {"run_id": "mine"}}).run_id == "mine"


def test_cli_reports_one_clear_error(tmp_path, capsys):
    p = _write(tmp_path, "modle:\n  dtype: float32\n")
    assert main(["run", str(p)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown key 'modle'" in err[0] and "did you mean 'model'" in err[0]


def test_reference_lists_every_key():
    ref = reference_markdown()
    for key in ("model.name_or_path", "corpus.paths", "tokenization.stride", "batching.max_tokens", "resources.num_workers"):
        assert f"`{key}`" in ref


BOMB_CHILD = r"""
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))  # the old loader's walk grew past 2 GB
from actlake.config import load_config
from actlake.errors import ConfigError
t0 = time.perf_counter()
try:
    load_config(sys.argv[1], check_files=False)
    msg = None
except ConfigError as e:
    msg = str(e)
hwm_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"msg": msg, "seconds": time.perf_counter() - t0, "maxrss_mb": hwm_kb / 1024}))
"""


def test_a_yaml_alias_bomb_is_refused_fast_and_small(tmp_path, capsys):
    """A real billion-laughs config (9 levels of 9 aliases: 9^9 strings): refused at its first anchor,
    naming file and line, in a few MB, in a child process with 1 GiB of address space (the old loader
    grew past 2 GB and never finished)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    levels = "abcdefghi"
    rows = ["name: bomb", f'{levels[0]}: &{levels[0]} [{", ".join(["lol"] * 9)}]']
    rows += [f"{cur}: &{cur} [{', '.join([f'*{prev}'] * 9)}]" for prev, cur in zip(levels, levels[1:])]
    p = _write(tmp_path, "\n".join(rows) + "\n")
    assert len(p.read_bytes()) < 500
    first_anchor_line = next(i for i, row in enumerate(rows, 1) if "&" in row)
    proc = subprocess.run([sys.executable, "-c", BOMB_CHILD, str(p)], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["msg"] and str(p) in out["msg"] and f"line {first_anchor_line}" in out["msg"] and "alias" in out["msg"]
    # bounded by memory, not by a clock (a loaded CI machine is slow); VmHWM, not ru_maxrss, which a child
    # inherits from the parent it was forked from
    assert out["maxrss_mb"] < 300, out
    assert main(["run", str(p)]) == 2  # and on the command line: one line
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("actlake: error:") and str(p) in err[0]


def test_a_merge_key_alias_is_refused_too(tmp_path):
    p = _write(tmp_path, "model:\n  dtype: float32\ntokenization:\n  <<: *x\n")
    with pytest.raises(ConfigError, match=r"line 4: YAML alias \*x"):
        load_config(p, check_files=False)


@pytest.mark.parametrize("case", ["file", "below_a_file", "not_writable", "run_dir_is_a_file"])
def test_output_dir_mistakes_are_one_line(tmp_path, capsys, minilm_path, case):
    """output.dir that is a file, lies below a file or cannot be written (root writes anywhere but /sys),
    and a run directory that is a file: one ``actlake: error:`` line naming the path, before Ray starts."""
    import json
    import os

    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "hello there"}) + "\n")
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    run_id = None
    if case == "file":
        out = blocker
    elif case == "below_a_file":
        out = blocker / "runs"
    elif case == "not_writable":
        out = tmp_path / "ro"
        out.mkdir()
        out.chmod(0o555)
        if os.geteuid() == 0:
            out = "/sys"
    else:
        out = tmp_path / "runs"
        out.mkdir()
        (out / "r1").write_text("a file where the run directory goes")
        run_id = "r1"
    cfg = {"model": {"name_or_path": minilm_path}, "corpus": {"paths": [str(tmp_path / "c.jsonl")]},
           "output": {"dir": str(out), "run_id": run_id, "report": False}}
    p = _write(tmp_path, json.dumps(cfg))
    assert main(["run", str(p)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("actlake: error:") and str(out) in err[0], err


@pytest.mark.parametrize("key,value", [("output.dir", "s4://bucket/runs"), ("corpus.paths", ["ftp://b/train/*.jsonl.zst"])])
def test_unknown_url_schemes_are_refused_in_one_line_not_made_local_folders(tmp_path, monkeypatch, key, value):
    """An unknown scheme must not become a folder named 's4:' in the working folder; s3/gs/hf URLs are accepted."""
    monkeypatch.chdir(tmp_path)
    section, name = key.split(".")
    p = _write(tmp_path, f"{section}:\n  {name}: {json.dumps(value)}\n")
    with pytest.raises(ConfigError, match=rf"line 2: '{key}.*uses the scheme \w+://, which actlake cannot read or write") as e:
        load_config(p, check_files=False)
    assert "\n" not in str(e.value)
    assert [x.name for x in tmp_path.iterdir()] == [p.name]
    known = "s3://bucket/runs" if key == "output.dir" else ["gs://b/train/*.jsonl.zst"]
    load_config(_write(tmp_path, f"{section}:\n  {name}: {json.dumps(known)}\n"), check_files=False)


def test_pydantic_models_keep_the_yaml_shorthands_and_messages(tmp_path):
    """One string for a list, ``0:`` keys for string keys, integers for floats; union and list errors name the key."""
    cfg = parse_config({"corpus": {"paths": "a.jsonl"}, "resources": {"cpus_per_worker": 2},
                        "model": {"device_map": "auto", "max_memory": {0: "1GiB"}}})
    assert cfg.corpus.paths == [os.path.abspath("a.jsonl")] and cfg.model.max_memory == {"0": "1GiB"}
    assert isinstance(cfg.resources.cpus_per_worker, float) and cfg.source_file == "<config>"
    assert parse_config({}).to_dict() == type(cfg)().to_dict()  # a section left out takes every default
    with pytest.raises(ConfigError, match=r"line 2: 'model.revision': expected str \| NoneType, got 5$"):
        load_config(_write(tmp_path, "model:\n  revision: 5\n"), check_files=False)
    with pytest.raises(ConfigError, match=r"line 4: 'activations.layers.1': expected an integer, got 'x'$"):
        load_config(_write(tmp_path, "activations:\n  layers:\n  - 1\n  - x\n"), check_files=False)
    with pytest.raises(ConfigError, match=r"line 2: 'sharding.commit_seconds': expected a number, got '1e-9' \(YAML reads"):
        load_config(_write(tmp_path, "sharding:\n  commit_seconds: 1e-9\n"), check_files=False)  # PyYAML: a string
    with pytest.raises(ConfigError, match=r"line 1: 'batching': 'batching' must be a mapping, got 3$"):
        load_config(_write(tmp_path, "batching: 3\n"), check_files=False)


def test_training_jobs_refuse_object_store_folders_in_one_line(tmp_path, monkeypatch):
    """Training jobs write checkpoints and read their store as local files: a URL is refused, never a folder 's3:'."""
    from actlake.jobs.train.lm.config import LMConfig
    from actlake.jobs.train.predictor.config import PredictorJobConfig

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"'output.dir': 's3://b/runs': training jobs write to a local folder"):
        parse_config({"output": {"dir": "s3://b/runs"}}, root=LMConfig)
    with pytest.raises(ConfigError, match=r"'store': 's3://b/x': must be a local folder or a shared mount"):
        parse_config({"store": "s3://b/x"}, root=PredictorJobConfig)
    assert list(tmp_path.iterdir()) == []


def test_every_path_a_config_holds_is_resolved_once_when_it_is_read(tmp_path, monkeypatch):
    """``~`` expanded, relative paths against the working directory, ``file://`` made a path, URLs untouched;
    in every job's config; and what ``submit`` sends the cluster is that resolved value, not a
    ``<cwd>/s3:/...`` folder (issue 31, item 1)."""
    from actlake.jobs.extract.plan import make_plan
    from actlake.jobs.extract.submit import absolute_config
    from actlake.jobs.train.lm.config import LMConfig
    from actlake.jobs.train.predictor.config import PredictorJobConfig

    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), (work / "model").mkdir(parents=True)
    (work / "model" / "config.json").write_text("{}")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    cfg = parse_config({"corpus": {"paths": ["s3://corpus/pile/*.jsonl", "~/pile/*.jsonl", "data/x.jsonl",
                                             "file:///srv/../srv/y.jsonl"]},
                        "model": {"name_or_path": "./model", "device_map": "auto", "offload_folder": "~/offload"},
                        "output": {"dir": "~/runs"}, "analyses": {"custom": [{"analysis": "m:C", "path": "code/m.py"}]}})
    assert cfg.corpus.paths == ["s3://corpus/pile/*.jsonl", f"{home}/pile/*.jsonl", f"{work}/data/x.jsonl", "/srv/y.jsonl"]
    assert (cfg.model.name_or_path, cfg.model.offload_folder) == (f"{work}/model", f"{home}/offload")
    assert cfg.analyses.custom[0].path == f"{work}/code/m.py"
    assert cfg.output.dir == f"{home}/runs" and str(cfg.run_dir) == f"{home}/runs/{cfg.run_id}"
    # a hub id and a package reference stay as written
    assert parse_config({"model": {"name_or_path": "EleutherAI/pythia-70m"}}).model.name_or_path == "EleutherAI/pythia-70m"
    assert parse_config({}).model.name_or_path.startswith("package:")
    # the config the cluster gets: URLs as written, local paths absolute; parsing it again changes nothing
    s3 = parse_config({"corpus": {"paths": ["s3://corpus/pile/*.jsonl.zst"]}, "output": {"dir": "s3://results/runs"}})
    sent = absolute_config(s3)
    assert sent["corpus"]["paths"] == ["s3://corpus/pile/*.jsonl.zst"] and sent["output"]["dir"] == "s3://results/runs"
    assert sent["output"]["run_id"] == s3.run_id and parse_config(sent).to_dict() == parse_config(sent).to_dict()
    assert absolute_config(cfg)["output"]["dir"] == f"{home}/runs"
    # the corpus index cache and the run folder are under the same resolved output.dir
    corpus = work / "data"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text('{"text": "one two three"}\n')
    local = parse_config({"corpus": {"paths": ["data/*.jsonl"]}, "output": {"dir": "~/runs"}})
    make_plan(local)
    assert (home / "runs" / "_corpus_index").is_dir() and sorted(p.name for p in work.iterdir()) == ["data", "model"]
    # the training jobs: output.dir, the tokenizer folder, the activation store
    lm = parse_config({"output": {"dir": "~/lm"}, "tokenizer": {"path": "tok"}}, root=LMConfig)
    assert (lm.output.dir, lm.tokenizer.path, str(lm.run_dir)) == (f"{home}/lm", f"{work}/tok", f"{home}/lm/{lm.run_id}")
    assert parse_config({"store": "~/store"}, root=PredictorJobConfig).store == f"{home}/store"


def test_the_layer_graphs_default_keeps_run_ids():
    """analyses.layer_graphs changes no result: its null default (on for GPU workers) hashes as the false it
    replaced, so a run made before keeps its id and resumes."""
    from actlake.config import parse_config

    ids = {parse_config({"name": "j", "analyses": a}).run_id for a in ({}, {"layer_graphs": False})}
    assert len(ids) == 1 and parse_config({"name": "j", "analyses": {"layer_graphs": True}}).run_id not in ids


def test_by_source_and_checkpoints_off_keep_run_ids_and_bad_checkpoints_are_named():
    """analyses.by_source / max_sources, model.checkpoints and tokenization.prepend_bos came after runs were made: off (their defaults)
    they hash as before, so those runs keep their ids and resume; a sweep's checkpoint needs a path or a
    revision and a label of its own."""
    base = parse_config({"name": "j"}).run_id  # at 81bbc5b, before the keys, this config's id was the same
    assert parse_config({"name": "j", "analyses": {"by_source": False, "max_sources": 5}}).run_id == base
    assert parse_config({"name": "j", "analyses": {"by_source": True}}).run_id != base
    assert parse_config({"name": "j", "tokenization": {"prepend_bos": False}}).run_id == base  # so does prepend_bos
    assert parse_config({"name": "j", "tokenization": {"prepend_bos": True}}).run_id != base
    with pytest.raises(ConfigError, match=r"model.checkpoints.1.*path .* or revision"):
        parse_config({"name": "j", "model": {"checkpoints": [{"path": "/tmp"}, {"step": 3}]}})
    with pytest.raises(ConfigError, match=r"label 'step-3' .* another checkpoint has it"):
        parse_config({"name": "j", "model": {"checkpoints": [{"revision": "a", "step": 3}, {"revision": "b", "step": 3}]}})
    with pytest.raises(ConfigError, match=r"analyses.max_sources.*at least 1"):
        parse_config({"name": "j", "analyses": {"max_sources": 0}})


def test_train_lm_snapshots_off_keep_run_ids_and_settings():
    """training.snapshots came after train-lm runs were made: off (0) it is left out of the config (its hash, the
    run id, the settings a resumed run is checked against), so those runs resume; on, it is another run."""
    from actlake.jobs.train.lm.config import LMConfig

    def lm(**training):
        return parse_config({"name": "lm", "corpus": {"paths": ["x.jsonl"]}, "training": training}, root=LMConfig)

    assert "snapshots" not in lm().to_dict()["training"] and "snapshots" not in lm(snapshots=0).to_dict()["training"]
    assert lm().to_dict() == lm(snapshots=0).to_dict() and lm().run_id == lm(snapshots=0).run_id
    assert lm(snapshots=7).to_dict()["training"]["snapshots"] == 7 and lm(snapshots=7).run_id != lm().run_id
    with pytest.raises(ConfigError, match=r"training.snapshots.*at least 2"):
        lm(snapshots=1)
