"""What decides a worker's numbers, for its REGISTER: the versions and build of what it
runs on. Two replicas of one pool that differ here may not give the same tokens (a torch
release, another CPU's kernels), and failover replays a stream onto either one."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zmqllm.bus.protocol import PROTOCOL_VERSION
from zmqllm.config.settings import Config
from zmqllm.engine import native
from zmqllm.version import __version__

__all__ = ["CPU_FEATURES", "build_info", "cpu_features"]

# The instruction sets torch's CPU kernels and ours (-march=native) pick their paths by.
CPU_FEATURES = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "amx_bf16",
    "amx_int8",
)


def cpu_features() -> str:
    """Those of CPU_FEATURES this CPU has, space-separated ("" where /proc says nothing)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            break
    return " ".join(f for f in CPU_FEATURES if f in flags)


def build_info(cfg: Config, kernel_loaded: bool, matrix_units: str = "off") -> dict[str, Any]:
    m = cfg.model
    device = m.device
    capability = torch.backends.cpu.get_cpu_capability()
    if device.startswith("cuda") and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(torch.device(device))
        capability = f"cuda sm_{major}{minor}, {torch.cuda.get_device_name(torch.device(device))}"
    return {
        "zmqllm": __version__,
        "protocol": PROTOCOL_VERSION,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "kernel": native.cache_key() if kernel_loaded else "none",
        "cpu": cpu_features()[:256],
        "capability": str(capability)[:256],
        "quant": m.quant,
        "dtype": m.dtype,
        "wire_dtype": cfg.worker.wire_dtype,
        "device": device,
        # The units the products of several rows run on, and with 8-bit activations or
        # not (native.use_matrix_units): each rounds differently.
        "matrix_units": matrix_units,
    }
