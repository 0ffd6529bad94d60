"""deploy/kubernetes/ validates against the Kubernetes schemas (kubernetes-validate bundles them), and its
manifests hold together: the coordinator does not supervise, the run directory is a claim, secrets exist, every
CMEMI container gets the Redis URL in CMEMI_REDIS_URL and its role's CurveZMQ keys at security.keys_dir.
One key per container: every compose service, swarm service and pod sees the public keys and only its own role's
secret keys (compose: what the `keys` service really writes into the volume each service mounts)."""

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


# The secret keys each role loads at start (shared.security.curve_from_config): servers the server pair,
# clients their own role's pair.
OWN_SECRETS = {"coordinator": {"coordinator.key_secret"}, "aggregator": {"server.key_secret", "aggregator.key_secret"},
               "checkpointer": {"server.key_secret"}, "worker": {"worker.key_secret"}}


def test_the_manifests_hold_together(tmp_path: Path) -> None:
    from cmemi.shared.wire.security import generate

    made = {p.name for p in generate(tmp_path / "keys")}  # what `cmemi keys DIR` writes: the Secret's keys
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
        container = spec["containers"][0]
        names = [e["name"] for e in container["env"]]
        env = {e["name"]: e for e in container["env"]}
        assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "cmemi-redis"
        # the URL through CMEMI_REDIS_URL (what the services read); $(REDIS_PASSWORD) expands only if defined before
        assert env["CMEMI_REDIS_URL"]["value"].startswith("redis://:$(REDIS_PASSWORD)@cmemi-redis:")
        assert names.index("REDIS_PASSWORD") < names.index("CMEMI_REDIS_URL")
        assert "PASSWORD" not in " ".join(container.get("command", []) + container["args"])
        # CurveZMQ keys: the Secret, required, mounted where security.keys_dir points
        mount = [m for m in container["volumeMounts"] if m["name"] == "keys"][0]
        assert env["CMEMI__SECURITY__KEYS_DIR"]["value"] == mount["mountPath"] and mount.get("readOnly")
        keys = [v for v in spec["volumes"] if v["name"] == "keys"][0]["secret"]
        role = container["name"]
        # a Secret per role: the node of a worker pod is never sent another role's secret key
        assert keys["secretName"] == f"cmemi-curve-{role}" and not keys.get("optional", False)
        projected = {item["key"] for item in keys["items"]}
        assert all(item["key"] == item["path"] for item in keys["items"])  # the file names security.py reads
        assert projected <= made, projected - made  # only files `cmemi keys` writes
        assert {"server.key", *OWN_SECRETS[role]} <= projected  # what the role loads at start
        assert {f for f in projected if f.endswith("_secret")} == OWN_SECRETS[role]  # no other role's secret
        assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsUser"]  # can read the 0440 files
        config = [v for v in spec["volumes"] if v["name"] == "config"][0]["configMap"]["name"]
        assert ("ConfigMap", config) in docs
    assert ("Secret", "cmemi-redis") in docs and ("Service", "cmemi-redis") in docs
    redis = docs[("Deployment", "cmemi-redis")]["spec"]["template"]["spec"]["containers"][0]
    assert "$(" not in " ".join(redis.get("command", []) + redis.get("args", []))  # no password on its command line
    # the config the services read is a valid CMEMI config
    from cmemi.shared.config.loading import config_from_dict

    config_from_dict(yaml.safe_load(docs[("ConfigMap", "cmemi-config")]["data"]["config.yaml"]), [])


def role_of(command: list[str]) -> str:
    """The role a CMEMI service runs as (an aggregator shard is the aggregator role)."""
    assert command[0] in OWN_SECRETS, command
    return command[0]


def volume_mount(entry: str | dict) -> dict:
    """A compose service's volume entry, short (`vol:/path[:ro]`) or long syntax, as the long syntax's fields."""
    if isinstance(entry, dict):
        return {"read_only": False, **entry, "nocopy": entry.get("volume", {}).get("nocopy", False)}
    source, target, *mode = entry.split(":")
    return {"source": source, "target": target, "read_only": mode == ["ro"], "nocopy": False}


def compose_services(*files: str) -> dict[str, dict]:
    """The services of compose files merged as `docker compose -f A -f B` does for what this test reads."""
    services: dict[str, dict] = {}
    for name in files:
        for svc, spec in yaml.safe_load((ROOT / name).read_text())["services"].items():
            services.setdefault(svc, {}).update(spec)
    return services


@pytest.mark.parametrize("files", [("docker-compose.yml",), ("docker-compose.yml", "docker-compose.shards.yml")])
def test_every_compose_service_sees_only_its_own_roles_secret_keys(tmp_path: Path, files: tuple[str, ...]) -> None:
    """Runs the `keys` service's command for real into a directory per volume it mounts, then reads what each
    CMEMI service finds at its security.keys_dir: the public keys, and only its own role's secret keys, enough
    for curve_from_config to start that role; the volume with every secret is mounted by the keys service alone."""
    from cmemi.shared.config.system import SecurityConfig
    from cmemi.shared.wire.security import curve_from_config

    from cmemi.cli import main

    services = compose_services(*files)
    keys_svc = services.pop("keys")
    mounts = dict(v.split(":")[:2] for v in keys_svc["volumes"])  # volume -> path inside the keys container
    assert set(mounts) == {"keys", *(f"keys-{role}" for role in OWN_SECRETS)}
    host = {vol: tmp_path / path.lstrip("/") for vol, path in mounts.items()}
    command = [arg.replace("/keys", str(tmp_path / "keys")) for arg in keys_svc["command"]]
    with pytest.raises(SystemExit) as done:  # `cmemi keys` exits with its status
        main(command)
    assert done.value.code == 0
    made = {p.name for p in host["keys"].iterdir()}
    public = {f for f in made if f.endswith(".key")}
    cmemi_services = {svc: spec for svc, spec in services.items() if svc != "redis"}
    assert {"coordinator", "aggregator", "checkpointer", "worker"} <= set(cmemi_services)
    for svc, spec in cmemi_services.items():
        role = role_of(spec["command"])
        mounts = [volume_mount(v) for v in spec["volumes"]]
        keys_dir = [m for m in mounts if m["target"] == "/keys"]
        assert len(keys_dir) == 1 and keys_dir[0]["read_only"], (svc, spec["volumes"])
        # nocopy: compose creates every container at once, and two (two workers, the aggregator and a shard) that
        # copy the image's /keys subdirectories into one fresh volume race ("mkdir .../_data/all: file exists")
        assert keys_dir[0]["nocopy"], (svc, spec["volumes"])
        volume = keys_dir[0]["source"]
        assert volume == f"keys-{role}", (svc, volume)
        assert not any(m["source"] == "keys" for m in mounts), svc  # never the volume of all secrets
        seen = {p.name for p in host[volume].iterdir()}
        assert seen == public | OWN_SECRETS[role], (svc, seen)
        curve_from_config(SecurityConfig(curve=True, keys_dir=str(host[volume])), role)  # all it needs is there
    assert {f for f in made if f.endswith("_secret")} == set().union(*OWN_SECRETS.values())


def test_the_swarm_stack_gives_every_service_its_keys_and_the_redis_url(tmp_path: Path) -> None:
    """docker/stack.yml, read statically (swarm-test runs it for real): each CMEMI service mounts the public keys and
    only its role's secret keys as /run/secrets/<the file name `cmemi keys` writes>, keys_dir points there, the
    Redis URL reaches it as CMEMI_REDIS_URL, and no password is put on a command line."""
    from cmemi.shared.wire.security import generate

    made = {p.name for p in generate(tmp_path / "keys")}
    stack = yaml.safe_load((ROOT / "docker" / "stack.yml").read_text())
    declared = stack["secrets"]
    assert all(declared[name].get("external") for name in declared)
    assert {f"cmemi-{f}" for f in made} <= set(declared)  # the documented step: a secret cmemi-FILE per file
    shards = yaml.safe_load((ROOT / "docker" / "stack.shards.yml").read_text())["services"]
    services = {**{role: stack["services"][role] for role in OWN_SECRETS}, "shard1": shards["shard1"]}
    for name, svc in services.items():
        own = OWN_SECRETS[role_of(svc["command"])]
        assert svc["environment"]["CMEMI__SECURITY__KEYS_DIR"] == "/run/secrets"
        assert 'export CMEMI_REDIS_URL="redis://:$$(cat /run/secrets/cmemi_redis_password)@redis:' in svc["entrypoint"][2]
        if name != "shard1":  # a shard has no healthcheck (docker/stack.shards.yml)
            assert "CMEMI_REDIS_URL=" in svc["healthcheck"]["test"][1]
        files = {}
        for grant in svc["secrets"]:
            if isinstance(grant, dict):
                assert grant["source"] == f"cmemi-{grant['target']}" and grant["source"] in declared
                files[grant["target"]] = grant
        assert set(files) <= made and {"server.key", *own} <= set(files)
        assert {f for f in files if f.endswith("_secret")} == own
        assert all(files[f]["mode"] == 0o400 and files[f]["uid"] == "10001" for f in own)
    redis = stack["services"]["redis"]["entrypoint"]
    assert "requirepass" not in redis[-1].split("redis-server", 1)[1]  # in its 0600 config file, not argv


def test_the_validation_catches_a_wrong_manifest() -> None:
    _, job = next((p, d) for p, d in documents() if d["metadata"]["name"] == "cmemi-worker")
    job["spec"]["template"]["spec"]["containers"][0]["resource"] = {}  # misspelt `resources`
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, kubernetes_validate.latest_version(), strict=True)
