"""Every manifest in deploy/k8s/ is valid Kubernetes: checked offline against the JSON
schemas of Kubernetes' own API (vendored in tests/unit/k8s_schemas/, strict: an unknown or
misspelled field is an error), and the check rejects broken manifests."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft202012Validator
from referencing import Registry, Resource

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
SCHEMAS = Path(__file__).resolve().parent / "k8s_schemas" / "v1.35.0-local-strict"
# (apiVersion, kind) -> its schema file; scripts/vendor_k8s_schemas.py vendors these kinds.
SCHEMA_FILES = {
    ("v1", "ConfigMap"): "configmap-v1.json",
    ("apps/v1", "Deployment"): "deployment-apps-v1.json",
    ("autoscaling/v2", "HorizontalPodAutoscaler"): "horizontalpodautoscaler-autoscaling-v2.json",
    ("v1", "PersistentVolumeClaim"): "persistentvolumeclaim-v1.json",
    ("v1", "Service"): "service-v1.json",
}

Manifest = dict[str, Any]


def load_manifests() -> list[tuple[str, Manifest]]:
    """(file relative to deploy/k8s, document) for every Kubernetes object there."""
    found = []
    for path in sorted(K8S.rglob("*.yaml")):
        if path.name == "kustomization.yaml":  # kustomize's own file, not an API object
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            assert isinstance(doc, dict), f"{path}: every YAML document must be one object"
            found.append((str(path.relative_to(K8S)), doc))
    return found


@functools.cache
def validator(api_version: str, kind: str) -> Draft202012Validator:
    name = SCHEMA_FILES.get((api_version, kind))
    if name is None:
        raise AssertionError(
            f"no vendored schema for {api_version} {kind}: add it to KINDS in "
            "scripts/vendor_k8s_schemas.py, rerun it and list it in SCHEMA_FILES"
        )
    definitions = json.loads((SCHEMAS / "_definitions.json").read_text())
    # The kinds refer to "/api/_definitions.json#/$defs/...", relative to their own $id.
    registry: Registry[Any] = Registry().with_resource(
        definitions["$id"], Resource.from_contents(definitions)
    )
    return Draft202012Validator(json.loads((SCHEMAS / name).read_text()), registry=registry)


def schema_errors(doc: Manifest) -> list[str]:
    """Each violation as 'path.to.field: message'; [] when the object is valid."""
    check = validator(str(doc.get("apiVersion")), str(doc.get("kind")))
    return [
        f"{'.'.join(str(p) for p in error.absolute_path) or '(top)'}: {error.message}"
        for error in sorted(check.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    ]


MANIFESTS = load_manifests()


def test_the_manifests_hold_what_kubernetes_needs_to_run_omnistage() -> None:
    kinds = sorted({(doc["kind"], doc["metadata"]["name"]) for _, doc in MANIFESTS})
    for name in ("coordinator", "ar-encoder", "dit-denoise", "vae-decode"):
        assert ("Deployment", name) in kinds and ("Service", name) in kinds, kinds
    for stage in ("ar-encoder", "dit-denoise", "vae-decode"):
        assert ("HorizontalPodAutoscaler", stage) in kinds, kinds
    assert ("ConfigMap", "omnistage-prometheus-adapter") in kinds


@pytest.mark.parametrize(
    "doc",
    [doc for _, doc in MANIFESTS],
    ids=[f"{f}:{d['kind']}/{d['metadata']['name']}" for f, d in MANIFESTS],
)
def test_manifest_is_valid_against_the_kubernetes_schema(doc: Manifest) -> None:
    errors = schema_errors(doc)
    assert not errors, "\n".join(errors)


def dit_deployment() -> Manifest:
    doc = next(
        d for _, d in MANIFESTS if d["kind"] == "Deployment" and d["metadata"]["name"] == "dit-denoise"
    )
    return copy.deepcopy(doc)


def _misspell_containers(doc: Manifest) -> None:
    pod = doc["spec"]["template"]["spec"]
    pod["contianers"] = pod.pop("containers")


def _replicas_as_words(doc: Manifest) -> None:
    doc["spec"]["replicas"] = "two"


def _probe_command_as_one_string(doc: Manifest) -> None:
    # An exec probe takes argv, a list: a shell-style string is no command.
    doc["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["exec"]["command"] = "omnistage health"


def _unknown_probe_field(doc: Manifest) -> None:
    doc["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["periodSecond"] = 10


@pytest.mark.parametrize(
    ("break_it", "where"),
    [
        (_misspell_containers, "spec.template.spec"),
        (_replicas_as_words, "spec.replicas"),
        (_probe_command_as_one_string, "spec.template.spec.containers.0.readinessProbe.exec.command"),
        (_unknown_probe_field, "spec.template.spec.containers.0.livenessProbe"),
    ],
)
def test_the_schema_check_rejects_a_broken_manifest(break_it: Any, where: str) -> None:
    doc = dit_deployment()
    assert schema_errors(doc) == []
    break_it(doc)
    errors = schema_errors(doc)
    assert errors, f"{break_it.__name__} went through the schema check"
    assert any(error.startswith(f"{where}:") for error in errors), errors


def test_a_kind_without_a_vendored_schema_is_an_error_not_a_pass() -> None:
    with pytest.raises(AssertionError, match="no vendored schema for batch/v1 Job"):
        schema_errors({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"}})
