"""deploy/k8s/ runs what docker-compose.yml runs (same image, commands, ports and
environment), and its pieces fit together: probes on the gRPC port, scrapes on the metrics
port, each stage's autoscaler on the load metric the code exports and the adapter serves,
memory-backed /dev/shm, drains that fit in the grace period."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

import pytest
import yaml

from omni_common.compose import interpolate
from omni_common.runtime.config import DRAIN_GRACE_S, STAGES
from omni_common.runtime.metrics import StageMetrics
from tests.unit.test_compose import COMPOSE
from tests.unit.test_k8s_schema import K8S, MANIFESTS, Manifest

# Set in Kubernetes only, and why: each pod has its own network namespace, so one metrics
# port fits all (the local cluster runs every service on one host and leaves it off); a
# stage pod's IP is how the coordinator reaches that very replica.
K8S_ONLY_ENV = {"OMNISTAGE_METRICS_PORT"}
K8S_ONLY_STAGE_ENV = {*K8S_ONLY_ENV, "OMNISTAGE_ADVERTISE_HOST"}
SERVICES = ("coordinator", *STAGES)

COMPOSE_DOC = yaml.safe_load(COMPOSE.read_text())


def find(kind: str, name: str) -> Manifest:
    matches = [d for _, d in MANIFESTS if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name!r} in deploy/k8s, found {len(matches)}"
    return matches[0]


def container(name: str) -> dict[str, Any]:
    (only,) = find("Deployment", name)["spec"]["template"]["spec"]["containers"]
    return dict(only)


def env_of(name: str) -> dict[str, Any]:
    return {item["name"]: item for item in container(name)["env"]}


def grpc_port(name: str) -> int:
    return int(env_of(name)["OMNISTAGE_PORT"]["value"])


def metrics_port(name: str) -> int:
    return int(env_of(name)["OMNISTAGE_METRICS_PORT"]["value"])


def test_kustomization_lists_every_manifest_but_the_adapter_rules() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    top_level = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(top_level)
    # Applied apart, in prometheus-adapter's namespace.
    assert (K8S / "monitoring" / "prometheus-adapter-rules.yaml").is_file()


def test_kustomize_builds_exactly_the_listed_objects() -> None:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed; the kustomization's file list is still checked")
    done = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    built = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(done.stdout)}
    listed = {(d["kind"], d["metadata"]["name"]) for f, d in MANIFESTS if not f.startswith("monitoring/")}
    assert built == listed


@pytest.mark.parametrize("name", SERVICES)
def test_deployment_runs_the_compose_service(name: str) -> None:
    declared = COMPOSE_DOC["services"][name]
    running = container(name)
    assert running["image"] == declared["image"]
    assert running["command"] == declared["command"]
    env = env_of(name)
    extra = K8S_ONLY_STAGE_ENV if name in STAGES else K8S_ONLY_ENV
    assert set(env) == set(declared["environment"]) | extra, (
        f"{name}: environment names differ from docker-compose.yml beyond {sorted(extra)}"
    )
    for key, value in declared["environment"].items():
        # Compose's defaults (${VAR:-default}) are what the manifests hard-code.
        assert env[key].get("value") == interpolate(str(value), {}), f"{name}: {key}"
    # The coordinator's Service name is the host compose's service name gave the stages.
    coordinator = env.get("OMNISTAGE_COORDINATOR", {}).get("value")
    if coordinator is not None:
        host, port = coordinator.split(":")
        assert int(port) in {p["port"] for p in find("Service", host)["spec"]["ports"]}


@pytest.mark.parametrize("name", SERVICES)
def test_probes_run_compose_healthcheck_on_its_port(name: str) -> None:
    # Kubernetes' own gRPC probe speaks plaintext only; every port serves TLS.
    check = COMPOSE_DOC["services"][name]["healthcheck"]["test"]
    compose_port = int(check[-1].rsplit(":", 1)[1])
    assert grpc_port(name) == compose_port
    running = container(name)
    assert {"name": "grpc", "containerPort": compose_port} in running["ports"]
    for probe in ("readinessProbe", "livenessProbe", *(["startupProbe"] if name in STAGES else [])):
        assert running[probe]["exec"] == {"command": check[1:]}, f"{name}: {probe}"
    service_ports = {p["name"]: p for p in find("Service", name)["spec"]["ports"]}
    assert service_ports["grpc"]["port"] == compose_port


@pytest.mark.parametrize("name", SERVICES)
def test_prometheus_scrapes_the_metrics_port(name: str) -> None:
    annotations = find("Deployment", name)["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == metrics_port(name) > 0
    assert {"name": "metrics", "containerPort": metrics_port(name)} in container(name)["ports"]


def adapter_rule() -> dict[str, Any]:
    config = yaml.safe_load(find("ConfigMap", "omnistage-prometheus-adapter")["data"]["config.yaml"])
    (rule,) = config["rules"]
    return dict(rule)


@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_scales_on_its_own_load_metric(stage: str) -> None:
    exported = {family.name for family in StageMetrics(stage, lambda: 0, lambda: 0).registry.collect()}
    assert "omnistage_stage_load" in exported
    rule = adapter_rule()
    assert rule["seriesQuery"].startswith("omnistage_stage_load{")
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
    hpa = find("HorizontalPodAutoscaler", stage)["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": stage}
    (metric,) = hpa["metrics"]
    # Type Pods: the average over this stage's own pods, which report only this stage.
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == rule["name"]["as"]
    assert 1 <= hpa["minReplicas"] < hpa["maxReplicas"]


def test_the_coordinator_is_one_replica_without_an_autoscaler() -> None:
    deployment = find("Deployment", "coordinator")["spec"]
    assert deployment["replicas"] == 1 and deployment["strategy"]["type"] == "Recreate"
    assert not [
        d
        for _, d in MANIFESTS
        if d["kind"] == "HorizontalPodAutoscaler" and d["spec"]["scaleTargetRef"]["name"] == "coordinator"
    ]


@pytest.mark.parametrize("name", SERVICES)
def test_pods_get_a_memory_backed_dev_shm_with_a_size_limit(name: str) -> None:
    pod = find("Deployment", name)["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in container(name)["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    shm = volumes[mounts["/dev/shm"]]["emptyDir"]
    assert shm["medium"] == "Memory" and shm["sizeLimit"]


@pytest.mark.parametrize("stage", STAGES)
def test_stages_mount_the_models_where_compose_does(stage: str) -> None:
    compose_volume = COMPOSE_DOC["services"][stage]["volumes"][0]
    _, target, _ = interpolate(compose_volume, {}).split(":")
    (mount,) = [m for m in container(stage)["volumeMounts"] if m["mountPath"] == target]
    assert mount.get("readOnly") is True
    pod = find("Deployment", stage)["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    claim = volume["persistentVolumeClaim"]["claimName"]
    assert find("PersistentVolumeClaim", claim)["spec"]["accessModes"] == ["ReadOnlyMany"]


@pytest.mark.parametrize("name", SERVICES)
def test_each_pod_gets_the_token_and_only_its_own_tls_key(name: str) -> None:
    env = env_of(name)
    spec = find("Deployment", name)["spec"]["template"]["spec"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "secrets"]
    (mount,) = [m for m in container(name)["volumeMounts"] if m["name"] == "secrets"]
    paths = {
        f"{mount['mountPath']}/{item['path']}"
        for source in volume["projected"]["sources"]
        for item in source["secret"]["items"]
    }
    wanted = ("OMNISTAGE_CLUSTER_TOKEN_FILE", "OMNISTAGE_TLS_CERT", "OMNISTAGE_TLS_KEY", "OMNISTAGE_TLS_CA")
    assert paths == {env[key]["value"] for key in wanted}
    assert env["OMNISTAGE_TLS_KEY"]["value"].endswith(f"/{name}-key.pem") and mount["readOnly"]


@pytest.mark.parametrize("name", ["ar-encoder", "dit-denoise", "vae-decode"])
def test_a_stage_keeps_its_compile_cache_on_a_shared_volume_as_in_compose(name: str) -> None:
    compose = COMPOSE_DOC["services"][name]
    target = compose["environment"]["OMNISTAGE_COMPILE_CACHE"]
    assert any(interpolate(v, {}).split(":")[1] == target for v in compose["volumes"])
    env = {e["name"]: e.get("value") for e in container(name)["env"]}
    assert env["OMNISTAGE_COMPILE_CACHE"] == target
    (mount,) = [m for m in container(name)["volumeMounts"] if m["mountPath"] == target]
    pod = find("Deployment", name)["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    claim = find("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # every replica reads and writes it


@pytest.mark.parametrize("name", SERVICES)
def test_termination_grace_outlasts_the_drain_as_in_compose(name: str) -> None:
    grace = find("Deployment", name)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    compose_grace = COMPOSE_DOC["services"][name]["stop_grace_period"]
    assert f"{grace}s" == compose_grace
    assert grace > DRAIN_GRACE_S + 5, "the drain needs time to stop the server and free shared memory"


def test_the_gateway_runs_the_compose_service_behind_an_http_probe() -> None:
    declared = COMPOSE_DOC["services"]["gateway"]
    running = container("gateway")
    assert running["image"] == declared["image"] and running["command"] == declared["command"]
    env = env_of("gateway")
    assert set(env) == set(declared["environment"])
    for key, value in declared["environment"].items():
        assert env[key].get("value") == interpolate(str(value), {}), f"gateway: {key}"
    # It reaches the coordinator through the coordinator's Service, on its gRPC port.
    host, port = env["OMNISTAGE_COORDINATOR"]["value"].split(":")
    assert int(port) in {p["port"] for p in find("Service", host)["spec"]["ports"]}
    # Probed where compose probes it: GET /health on the HTTP port.
    health_url = declared["healthcheck"]["test"][-1]
    http_port = int(env["OMNISTAGE_PORT"]["value"])
    assert health_url == f"http://127.0.0.1:{http_port}/health"
    assert {"name": "http", "containerPort": http_port} in running["ports"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert running[probe]["httpGet"] == {"path": "/health", "port": http_port}, probe
    assert {p["name"]: p["port"] for p in find("Service", "gateway")["spec"]["ports"]} == {"http": http_port}
    annotations = find("Deployment", "gateway")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == http_port  # served beside the API
    grace = find("Deployment", "gateway")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert f"{grace}s" == declared["stop_grace_period"] and grace > DRAIN_GRACE_S + 5
