"""The image deploy/Containerfile describes, built as an operator would here and run.

`deploy/build-image` makes a Debian base with debootstrap (no registry is reachable),
builds the image with podman, then a broker, a worker and a gateway each run in a
container of it (podman with the runc runtime and explicit ulimits, as these machines
need; host networking, free ports), with CURVE on from a key folder mounted read-only.
The worker builds its compiled kernel inside its container on first use; greedy /chat
equals HF's. Everything the test made (containers, images) is removed after.

Needs root, podman and debootstrap: .ci/run installs them, so under CI a missing one
fails the test; elsewhere it is skipped with the reason.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testbed.cluster import free_port
from zmqllm.log import KERNELS_BUILT
from zmqllm.version import __version__

pytestmark = [pytest.mark.e2e, pytest.mark.torch, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI") == "true"
PROMPTS = ["Why is the sky blue?", "Count to five."]
IMAGE_UID = 10001  # the user deploy/Containerfile runs every role as


def missing() -> str | None:
    if os.geteuid() != 0:
        return "building the base image with debootstrap needs root"
    for tool in ("podman", "debootstrap", "runc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install podman debootstrap runc)"
    return None


def podman(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["podman", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def ulimits() -> list[str]:
    """crun refuses these machines' cgroup setup and runc cannot raise a limit past the
    caller's hard limit: both ulimits are given, within it."""
    flags = []
    for name, which, want in (
        ("nofile", resource.RLIMIT_NOFILE, 65536),
        ("nproc", resource.RLIMIT_NPROC, 32768),
    ):
        hard = resource.getrlimit(which)[1]
        n = want if hard == resource.RLIM_INFINITY else min(want, hard)
        flags += ["--ulimit", f"{name}={n}:{n}"]
    return flags


class Containers:
    """The role containers of one test: started detached, always removed."""

    def __init__(self, image: str, mounts: dict[Path, str]) -> None:
        self.image, self.names = image, []
        self.mounts = [f"--volume={src}:{dst}:ro" for src, dst in mounts.items()]
        self.tag = f"zmqllm-test-{os.getpid()}"

    def run(self, role: str, *args: str) -> str:
        name = f"{self.tag}-{role}"
        self.names.append(name)
        done = podman(
            "run", "--detach", "--name", name, "--runtime", "runc", *ulimits(),
            "--network", "host", *self.mounts, self.image, role, *args,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return name

    def logs(self, name: str) -> str:
        return podman("logs", name).stdout + podman("logs", name).stderr

    def state(self, name: str) -> str:
        return podman("inspect", "--format", "{{.State.Status}}", name).stdout.strip()

    def remove(self) -> None:
        if self.names:
            podman("rm", "--force", "--time", "5", *self.names)


@pytest.fixture(scope="module")
def image() -> Iterator[str]:
    reason = missing()
    if reason is not None:
        if IN_CI:
            pytest.fail(f"{reason}: .ci/run installs it")
        pytest.skip(reason)
    tag = f"localhost/zmqllm:test-{os.getpid()}"
    base = "localhost/zmqllm-base:bookworm"
    base_made = podman("image", "exists", base).returncode != 0
    done = subprocess.run(
        [str(ROOT / "deploy/build-image"), "--tag", tag],
        capture_output=True,
        text=True,
        timeout=1500,
        check=False,
    )
    try:
        assert done.returncode == 0, done.stderr[-4000:]
        assert done.stdout.strip() == tag
        yield tag
    finally:
        podman("rmi", "--force", tag)
        if base_made:
            podman("rmi", "--force", base)


def get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:  # not listening yet
        return 0, b""


def chat(port: int, prompt: str, max_tokens: int) -> str:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/chat?max_tokens={max_tokens}", data=prompt.encode()
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200
        return resp.read().decode()


@pytest.mark.timeout(2400)
def test_image_serves_a_cluster_exactly(
    image: str, e2e_model: Path, reference: Any, tmp_path: Path
) -> None:
    version = podman("run", "--rm", "--runtime", "runc", *ulimits(), image, "--version")
    assert version.stdout.split() == ["zmqllm", __version__], version.stderr
    # The Ray deploy/raycluster.yaml's RayCluster names (KubeRay wants them to agree).
    ray = podman(
        "run", "--rm", "--runtime", "runc", *ulimits(), "--entrypoint=python", image,
        "-c", "import ray; print(ray.__version__)",
    )  # fmt: skip
    manifest = (ROOT / "deploy/raycluster.yaml").read_text()
    assert f'rayVersion: "{ray.stdout.strip()}"' in manifest, ray.stderr

    # The image runs as its own user, not root (deploy/Containerfile).
    user = podman("run", "--rm", "--runtime", "runc", *ulimits(), "--entrypoint=id", image, "-u")
    assert user.stdout.strip() == str(IMAGE_UID), user.stderr
    # The key folder made by the image's own `zmqllm keys init`, as an operator would: in a
    # folder of the image's user, so that the roles (that user too) read what it wrote.
    keys = tmp_path / "keys"
    keys.mkdir()
    os.chown(keys, IMAGE_UID, IMAGE_UID)
    made = podman(
        "run", "--rm", "--runtime", "runc", *ulimits(), f"--volume={keys}:/keys",
        image, "keys", "init", "/keys/cluster",
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    keys = keys / "cluster"
    frontend, backend, http = free_port(), free_port(), free_port()
    # The model as an operator mounts it: files the image's user may read (the fixture's
    # safetensors file is its owner's only).
    model = tmp_path / "tiny"
    shutil.copytree(e2e_model, model)
    for path in [model, *model.rglob("*")]:
        os.chown(path, IMAGE_UID, IMAGE_UID)
    roles = Containers(image, {keys: "/var/lib/zmqllm/keys", model: "/models/tiny"})
    try:
        broker = roles.run(
            "broker", f"--frontend=tcp://127.0.0.1:{frontend}",
            f"--backend=tcp://127.0.0.1:{backend}", "--log-format=json",
        )  # fmt: skip
        worker = roles.run(
            "worker", f"--broker=tcp://127.0.0.1:{backend}", "--model=/models/tiny",
            "--threads=1", "--log-format=json",
        )  # fmt: skip
        gateway = roles.run(
            "gateway", f"--broker=tcp://127.0.0.1:{frontend}", "--host=127.0.0.1",
            f"--port={http}", "--model=/models/tiny", "--log-format=json",
        )  # fmt: skip
        # Ready = a warm-up token came back through the worker, whose kernel is built first.
        started = time.monotonic()
        deadline = started + 600
        while get(f"http://127.0.0.1:{http}/ready")[0] != 200:
            for name in (broker, worker, gateway):
                assert roles.state(name) == "running", roles.logs(name)[-3000:]
            assert time.monotonic() < deadline, roles.logs(worker)[-3000:]
            time.sleep(1.0)
        print(f"[container] three containers to /ready: {time.monotonic() - started:.1f} s")
        for prompt in PROMPTS:
            assert chat(http, prompt, 24) == reference.body(prompt, 24), prompt
        status, body = get(f"http://127.0.0.1:{http}/cluster/status")
        assert status == 200
        workers = json.loads(body)["broker"]["workers"]
        assert len(workers) == 1 and workers[0]["layers"] == [0, 4]
        lines = [json.loads(x) for x in roles.logs(worker).splitlines() if x.startswith("{")]
        assert any(x.get("event") == KERNELS_BUILT for x in lines), "no kernel built in the image"
    finally:
        roles.remove()
    assert podman("ps", "--all", "--filter", f"name={roles.tag}", "--quiet").stdout == ""
