"""The k8s/ overlays build with kustomize and validate against Kubernetes and CRD schemas, offline.

The tools come from scripts/stack.d/tools.sh (cached; the first run builds kustomize and kubeconform with
`go install`, takes the Kubernetes JSON schemas from the PyPI package kubernetes-validate and the KEDA and
Prometheus Operator validators from npm). Beyond the schemas, the checks tie the manifests to the code: settings
names, topic names, the consumer group, the gateway's health path and the dashboards folder.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.settings import DEFAULT_SECRETS_DIR, Settings
from streams.topics import TopicNames

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TOOLS_SCRIPT = ROOT / "scripts" / "stack.d" / "tools.sh"
CRD_SCRIPT = ROOT / "scripts" / "stack.d" / "validate-crds.mjs"
OVERLAYS = ("dev", "prod")
CRD_KINDS = ("ScaledObject", "ServiceMonitor", "TriggerAuthentication")
# The stores' addresses: not Settings fields yet (their adapters add them); scripts/stack exports the same names.
STACK_ADDRESSES = {"MEMSTREAM_DGRAPH", "MEMSTREAM_WEAVIATE_HTTP", "MEMSTREAM_WEAVIATE_GRPC"}
POD_OWNERS = ("Deployment", "StatefulSet")

Manifest = dict[str, Any]


@pytest.fixture(scope="module")
def tools() -> dict[str, str]:
    done = subprocess.run(
        ["bash", str(TOOLS_SCRIPT)], capture_output=True, text=True, timeout=1800, check=False, cwd=ROOT
    )
    assert done.returncode == 0, f"tools.sh failed:\n{done.stderr[-3000:]}"
    return dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)


def build(tools: dict[str, str], overlay: str) -> str:
    done = subprocess.run(
        [
            tools["KUSTOMIZE"],
            "build",
            "--load-restrictor",
            "LoadRestrictionsNone",
            str(ROOT / "k8s" / "overlays" / overlay),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"kustomize build {overlay} failed:\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def rendered(tools: dict[str, str]) -> dict[str, str]:
    return {overlay: build(tools, overlay) for overlay in OVERLAYS}


@pytest.fixture(scope="module")
def manifests(rendered: dict[str, str]) -> dict[str, list[Manifest]]:
    return {overlay: [d for d in yaml.safe_load_all(text) if d] for overlay, text in rendered.items()}


def kubeconform(tools: dict[str, str], text: str) -> tuple[int, list[dict[str, Any]]]:
    """Validate manifests; the custom resources are skipped here and checked by validate-crds.mjs instead."""
    done = subprocess.run(
        [
            tools["KUBECONFORM"],
            "-strict",
            "-verbose",
            "-output",
            "json",
            "-kubernetes-version",
            tools["K8S_VERSION"],
            "-schema-location",
            tools["K8S_SCHEMA_LOCATION"],
            "-skip",
            ",".join(CRD_KINDS),
            "-",
        ],
        input=text,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.stdout, done.stderr
    return done.returncode, json.loads(done.stdout)["resources"]


def validate_crds(tools: dict[str, str], docs: list[Manifest]) -> tuple[int, list[dict[str, Any]]]:
    done = subprocess.run(
        ["node", str(CRD_SCRIPT)],
        input=json.dumps(docs),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "CRD_MODULES": tools["CRD_MODULES"]},
    )
    assert done.stdout, done.stderr
    return done.returncode, [json.loads(line) for line in done.stdout.splitlines()]


def find(docs: list[Manifest], kind: str, name: str) -> Manifest:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


def config_map(docs: list[Manifest], prefix: str) -> Manifest:
    matches = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith(prefix)]
    assert len(matches) == 1, f"ConfigMap {prefix}*: {len(matches)} found"
    return matches[0]


def pod_specs(docs: list[Manifest]) -> Iterator[tuple[str, Manifest]]:
    for doc in docs:
        if doc["kind"] in POD_OWNERS:
            yield f"{doc['kind']}/{doc['metadata']['name']}", doc["spec"]["template"]["spec"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_is_valid_for_kubernetes(tools: dict[str, str], rendered: dict[str, str], overlay: str) -> None:
    code, resources = kubeconform(tools, rendered[overlay])
    problems = [r for r in resources if r["status"] not in ("statusValid", "statusSkipped")]
    assert code == 0 and not problems, problems
    skipped = {r["kind"] for r in resources if r["status"] == "statusSkipped"}
    assert skipped <= set(CRD_KINDS)  # only the custom resources, which the next test validates
    kinds = {r["kind"] for r in resources if r["status"] == "statusValid"}
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap", "Namespace"} <= kinds


def test_custom_resources_are_valid_for_their_crds(tools: dict[str, str], manifests: dict[str, list[Manifest]]) -> None:
    custom = [d for d in manifests["prod"] if d["kind"] in CRD_KINDS]
    assert sorted({d["kind"] for d in custom}) == sorted(CRD_KINDS)
    code, results = validate_crds(tools, custom)
    assert code == 0 and all(r["valid"] for r in results), results
    # dev targets clusters without the KEDA and Prometheus operators
    assert not [d for d in manifests["dev"] if d["kind"] in CRD_KINDS]


def test_validators_reject_broken_manifests(tools: dict[str, str]) -> None:
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "broken"},
        "spec": {"replicas": "two", "selector": {}, "template": {"spec": {"containers": [{"name": "c", "imag": "x"}]}}},
    }
    code, resources = kubeconform(tools, yaml.safe_dump(deployment))
    assert code != 0 and resources[0]["status"] == "statusInvalid"
    assert "replicas" in resources[0]["msg"]

    scaled = {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": {"name": "x"}, "spec": {}}
    code, results = validate_crds(tools, [scaled])
    assert code != 0 and not results[0]["valid"] and "scaleTargetRef" in results[0]["error"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_is_non_root_and_bounded(manifests: dict[str, list[Manifest]], overlay: str) -> None:
    for owner, spec in pod_specs(manifests[overlay]):
        assert spec["securityContext"]["runAsNonRoot"] is True, owner
        assert spec["securityContext"]["runAsUser"] != 0, owner
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, owner
        for container in spec["containers"]:
            where = f"{owner}/{container['name']}"
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False, where
            assert security["capabilities"]["drop"] == ["ALL"], where
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]), where
            assert "memory" in resources["limits"], where


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_is_probed_on_healthz(manifests: dict[str, list[Manifest]], overlay: str) -> None:
    docs = manifests[overlay]
    container = find(docs, "Deployment", "memstream-gateway")["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == ["gateway"]
    port = next(p for p in container["ports"] if p["name"] == "http")
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "http"}
    config = config_map(docs, "memstream-config")["data"]
    assert port["containerPort"] == int(config["MEMSTREAM_PORT"])
    service = find(docs, "Service", "memstream-gateway")["spec"]
    assert service["ports"][0]["targetPort"] == "http"
    worker = find(docs, "Deployment", "memstream-worker")["spec"]["template"]["spec"]["containers"][0]
    assert worker["args"] == ["worker"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_settings_come_from_memstream_env(
    manifests: dict[str, list[Manifest]], overlay: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = manifests[overlay]
    config = config_map(docs, "memstream-config")
    fields = {f"MEMSTREAM_{name.upper()}" for name in Settings.model_fields}
    unknown = set(config["data"]) - fields - STACK_ADDRESSES
    assert not unknown, f"not settings in services/settings.py: {sorted(unknown)}"
    for name, value in config["data"].items():
        monkeypatch.setenv(name, value)
    settings = Settings(_env_file=None)  # every value parses into its field's type
    assert settings.llm == "ollama" and settings.broker == "kafka:9092"
    # every memstream container reads the whole ConfigMap
    for owner in ("memstream-worker", "memstream-gateway"):
        container = find(docs, "Deployment", owner)["spec"]["template"]["spec"]["containers"][0]
        assert container["envFrom"] == [{"configMapRef": {"name": config["metadata"]["name"]}}]


def test_workers_autoscale_on_the_lag_of_their_input_topics(
    manifests: dict[str, list[Manifest]], monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = manifests["prod"]
    config = config_map(docs, "memstream-config")["data"]
    for name, value in config.items():
        monkeypatch.setenv(name, value)
    settings = Settings(_env_file=None)
    topics = TopicNames.from_settings(settings)
    scaled = find(docs, "ScaledObject", "memstream-worker")["spec"]
    worker = find(docs, "Deployment", scaled["scaleTargetRef"]["name"])
    assert "replicas" not in worker["spec"]  # KEDA owns it
    triggers = scaled["triggers"]
    assert {t["type"] for t in triggers} == {"kafka"}
    assert sorted(t["metadata"]["topic"] for t in triggers) == sorted([topics.chat, topics.documents, topics.queries])
    for trigger in triggers:
        assert trigger["metadata"]["consumerGroup"] == settings.consumer_group
        assert trigger["metadata"]["bootstrapServers"] == settings.broker
    assert 1 <= scaled["minReplicaCount"] <= scaled["maxReplicaCount"] <= settings.partitions
    # dev runs a fixed worker count instead
    assert find(manifests["dev"], "Deployment", "memstream-worker")["spec"]["replicas"] == 1


def test_kafka_quorum_matches_its_replicas(manifests: dict[str, list[Manifest]]) -> None:
    for overlay, docs in manifests.items():
        kafka = find(docs, "StatefulSet", "kafka")
        env = {e["name"]: e.get("value") for e in kafka["spec"]["template"]["spec"]["containers"][0]["env"]}
        voters = env["KAFKA_CONTROLLER_QUORUM_VOTERS"].split(",")
        assert [v.split("@")[0] for v in voters] == [str(i) for i in range(kafka["spec"]["replicas"])], overlay
        replication = int(config_map(docs, "memstream-config")["data"]["MEMSTREAM_REPLICATION_FACTOR"])
        assert replication <= kafka["spec"]["replicas"], overlay


def test_dashboards_configmap_holds_every_dashboard(manifests: dict[str, list[Manifest]]) -> None:
    on_disk = sorted(p.name for p in (ROOT / "dashboards").glob("*.json"))
    component = yaml.safe_load((ROOT / "k8s/components/dashboards/kustomization.yaml").read_text())
    listed = sorted(Path(f).name for f in component["configMapGenerator"][0]["files"])
    assert listed == on_disk, "dashboards/ changed: run scripts/stack.d/k8s-dashboards.sh"
    for docs in manifests.values():
        dashboards = find(docs, "ConfigMap", "grafana-dashboards")
        assert dashboards["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert sorted(dashboards.get("data") or {}) == on_disk
        for name, text in (dashboards.get("data") or {}).items():
            assert isinstance(json.loads(text), dict), name


def stack_versions() -> dict[str, str]:
    """The versions pinned in scripts/stack.d/common.sh (NAME=VALUE lines)."""
    text = (ROOT / "scripts" / "stack.d" / "common.sh").read_text()
    pairs = (line.split("#")[0].strip().split("=", 1) for line in text.splitlines() if "_VERSION=" in line)
    return {name: value.strip() for name, value in pairs}


def test_server_images_match_the_versions_ci_runs(manifests: dict[str, list[Manifest]]) -> None:
    versions = stack_versions()
    expected = {
        "apache/kafka": versions["KAFKA_VERSION"],
        "dgraph/dgraph": versions["DGRAPH_VERSION"],
        "cr.weaviate.io/semitechnologies/weaviate": versions["WEAVIATE_VERSION"].removeprefix("v"),
        "ollama/ollama": versions["OLLAMA_VERSION"].removeprefix("v"),
    }
    for overlay, docs in manifests.items():
        images = {
            container["image"]
            for _, spec in pod_specs(docs)
            for container in spec["containers"]
            if not container["image"].split(":")[0].endswith("memstream")
        }
        assert images == {f"{name}:{tag}" for name, tag in expected.items()}, overlay


def container_of(docs: list[Manifest], kind: str, name: str, container: str | None = None) -> Manifest:
    spec = find(docs, kind, name)["spec"]["template"]["spec"]
    return next(c for c in spec["containers"] if container is None or c["name"] == container)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_credentials_come_from_secrets(manifests: dict[str, list[Manifest]], overlay: str) -> None:
    """Transport security (docs/security.md): memstream reads its secrets as files from the memstream-credentials
    Secret; Weaviate and Dgraph take theirs from the same Secret; the committed values are placeholders only."""
    docs = manifests[overlay]
    credentials = find(docs, "Secret", "memstream-credentials")
    assert set(credentials["data"]) >= {
        "memstream_dgraph_password",
        "memstream_dgraph_token",
        "memstream_weaviate_api_key",
    }
    for doc in (credentials, find(docs, "Secret", "dgraph-acl"), find(docs, "Secret", "memstream-metrics-key")):
        assert all(base64.b64decode(v).startswith(b"change-me") for v in doc["data"].values()), doc["metadata"]
    for owner in ("memstream-worker", "memstream-gateway"):
        spec = find(docs, "Deployment", owner)["spec"]["template"]["spec"]
        volume = next(
            v["name"]
            for v in spec["volumes"]
            if v.get("secret", {}).get("secretName") == credentials["metadata"]["name"]
        )
        mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
        assert mounts[volume] == str(DEFAULT_SECRETS_DIR), owner
    weaviate = {e["name"]: e for e in container_of(docs, "StatefulSet", "weaviate")["env"]}
    assert weaviate["AUTHENTICATION_ANONYMOUS_ACCESS_ENABLED"]["value"] == "false"
    assert weaviate["AUTHENTICATION_APIKEY_ALLOWED_KEYS"]["valueFrom"]["secretKeyRef"] == {
        "name": "memstream-credentials",
        "key": "memstream_weaviate_api_key",
    }
    alpha = container_of(docs, "StatefulSet", "dgraph-alpha", "alpha")
    assert "--acl=" in alpha["args"][0] and "token=${DGRAPH_ADMIN_TOKEN}" in alpha["args"][0]
    alpha_env = {e["name"]: e for e in alpha["env"]}
    assert alpha_env["DGRAPH_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "memstream_dgraph_token"
    config = config_map(docs, "memstream-config")["data"]
    assert config["MEMSTREAM_DGRAPH_USER"] == "groot"
    # Kafka: SCRAM for clients and brokers, the user's password from the same Secret the clients read
    assert config["MEMSTREAM_KAFKA_SECURITY_PROTOCOL"] == "SASL_PLAINTEXT"
    assert config["MEMSTREAM_KAFKA_SASL_MECHANISM"] == "SCRAM-SHA-256"
    assert "memstream_kafka_password" in credentials["data"]
    kafka = container_of(docs, "StatefulSet", "kafka")
    kafka_env = {e["name"]: e.get("value") for e in kafka["env"]}
    assert kafka_env["KAFKA_LISTENERS"].startswith("SASL_PLAINTEXT://")
    assert kafka_env["KAFKA_INTER_BROKER_LISTENER_NAME"] == "SASL_PLAINTEXT"
    assert config["MEMSTREAM_KAFKA_USERNAME"] == kafka_env["KAFKA_SCRAM_USER"]
    assert "--add-scram" in kafka["args"][0] and "memstream_kafka_password" in kafka["args"][0]
    if overlay == "prod":  # KEDA reads the lags as that user too
        triggers = find(docs, "ScaledObject", "memstream-worker")["spec"]["triggers"]
        assert {t["authenticationRef"]["name"] for t in triggers} == {"memstream-kafka"}
        refs = find(docs, "TriggerAuthentication", "memstream-kafka")["spec"]["secretTargetRef"]
        assert {r["parameter"]: r["key"] for r in refs}["password"] == "memstream_kafka_password"


def test_prometheus_scrapes_the_gateway_with_the_metrics_key(manifests: dict[str, list[Manifest]]) -> None:
    plain = yaml.safe_load(config_map(manifests["dev"], "prometheus-scrape")["data"]["prometheus.yml"])
    pods = next(job for job in plain["scrape_configs"] if job["job_name"] == "memstream-pods")
    assert pods["authorization"] == {
        "type": "Bearer",
        "credentials_file": "/etc/prometheus/secrets/memstream-metrics-key/token",
    }
    monitor = find(manifests["prod"], "ServiceMonitor", "memstream-gateway")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["authorization"]["credentials"] == {"name": "memstream-metrics-key", "key": "token"}
    find(manifests["prod"], "Secret", "memstream-metrics-key")
