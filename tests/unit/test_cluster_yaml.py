"""cluster.yaml validates against Ray's own cluster-launcher schema."""

import json
from pathlib import Path

import jsonschema
import ray
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _schema():
    return json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())


def test_cluster_yaml_matches_ray_schema():
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    jsonschema.validate(config, _schema())
    workers = config["available_node_types"]["gpu_worker"]["node_config"]["InstanceType"]
    assert workers.startswith(("g", "p"))  # GPU instance family
    assert any("pip install -e ~/actlake" in c for c in config["setup_commands"])
    assert "--dashboard-host=127.0.0.1" in " ".join(config["head_start_ray_commands"])


def test_schema_rejects_a_misspelt_key():
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    config["max_worker"] = 3
    try:
        jsonschema.validate(config, _schema())
    except jsonschema.ValidationError as e:
        assert "max_worker" in str(e)
    else:
        raise AssertionError("schema accepted an unknown top-level key")
