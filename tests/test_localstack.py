"""localstack/docker-compose.yml stays a valid compose file (no Docker engine needed)."""

from __future__ import annotations

from pathlib import Path

import yaml

COMPOSE = Path(__file__).resolve().parents[1] / "localstack" / "docker-compose.yml"


def test_compose_file_defines_minio_and_localstack_on_loopback():
    spec = yaml.safe_load(COMPOSE.read_text())
    services = spec["services"]
    assert {"minio", "minio-setup", "localstack"} <= set(services)
    for name in ("minio", "localstack"):
        assert services[name]["ports"] and all(p.startswith("127.0.0.1:") for p in services[name]["ports"])
    assert services["minio"]["environment"]["MINIO_ROOT_USER"] == "minioadmin"
