"""deploy/kubernetes/ validates against the Kubernetes schemas (kubernetes-validate bundles them), and its
manifests hold together: the coordinator does not supervise, the run directory is a claim, secrets exist."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.conftest import ROOT

K8S = ROOT / "deploy" / "kubernetes"


def documents() -> list[tuple[Path, dict]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        out += [(path, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return out


@pytest.mark.parametrize("version", ["1.29.0", kubernetes_validate.latest_version()])
def test_every_manifest_validates_against_the_kubernetes_schemas(version: str) -> None:
    docs = documents()
    assert len(docs) >= 9
    for path, doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)  # strict: unknown fields are errors too
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path.name}: {doc['kind']} {doc['metadata']['name']}: {exc.message} at {list(exc.path)}")


def test_the_manifests_hold_together() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in documents()}
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")

    def pod(name: str) -> dict:
        return docs[("Job", name)]["spec"]["template"]["spec"]

    assert pod("cmemi-coordinator")["containers"][0]["args"][-2:] == ["--supervise", "none"]
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod("cmemi-checkpointer")["volumes"]
              if "persistentVolumeClaim" in v}
    assert claims == {"cmemi-runs"} and ("PersistentVolumeClaim", "cmemi-runs") in docs
    assert docs[("Job", "cmemi-worker")]["spec"]["parallelism"] >= 2
    for name in ("cmemi-coordinator", "cmemi-aggregator", "cmemi-checkpointer", "cmemi-worker"):
        spec = pod(name)
        assert spec["restartPolicy"] == "OnFailure"
        env = {e["name"]: e for e in spec["containers"][0]["env"]}
        assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "cmemi-redis"
        assert env["CMEMI__CLUSTER__REDIS"]["value"].startswith("redis://:$(REDIS_PASSWORD)@cmemi-redis:")
        keys = [v for v in spec["volumes"] if v["name"] == "keys"][0]["secret"]
        assert keys["secretName"] == "cmemi-curve-keys"
        config = [v for v in spec["volumes"] if v["name"] == "config"][0]["configMap"]["name"]
        assert ("ConfigMap", config) in docs
    assert ("Secret", "cmemi-redis") in docs and ("Service", "cmemi-redis") in docs
    # the config the services read is a valid CMEMI config
    from cmemi.shared.config import config_from_dict

    config_from_dict(yaml.safe_load(docs[("ConfigMap", "cmemi-config")]["data"]["config.yaml"]), [])


def test_the_validation_catches_a_wrong_manifest() -> None:
    _, job = next((p, d) for p, d in documents() if d["metadata"]["name"] == "cmemi-worker")
    job["spec"]["template"]["spec"]["containers"][0]["resource"] = {}  # misspelt `resources`
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, kubernetes_validate.latest_version(), strict=True)
