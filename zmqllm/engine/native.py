"""The optional compiled decode-attention kernel (csrc/decode_attention.cpp),
with the small per-layer steps of a batched decode forward (RMSNorm, rotary
embedding, silu(gate) * up) fused beside it.

Built on first use with torch's C++ extension loader (a C++ compiler and ninja
are needed) into ``~/.cache/zmqllm/kernels``, once per source, torch version and
environment; later loads take well under a second. Where it cannot be built, or
with ``ZMQLLM_NATIVE=0``, the engine keeps its pure-PyTorch path: same results
to float32 rounding, slower when many sessions decode at once.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

from zmqllm.log import get_logger

log = get_logger("zmqllm.engine.native")

SOURCE = Path(__file__).parent / "csrc" / "decode_attention.cpp"
_lock = threading.Lock()
_state: dict[str, ModuleType | None] = {}
# Longest wait for another process's build of the same kernel; past it, the PyTorch path.
BUILD_WAIT_S = 900.0


def enabled() -> bool:
    return os.environ.get("ZMQLLM_NATIVE", "1").lower() not in ("0", "false", "no", "off")


def build_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "zmqllm" / "kernels"


def load() -> ModuleType | None:
    """The compiled module, building it if needed; None where it cannot be had
    (the reason is logged once)."""
    with _lock:
        if "module" not in _state:
            _state["module"] = _build() if enabled() else None
        return _state["module"]


def _build() -> ModuleType | None:
    from torch.utils import cpp_extension

    # ninja from the `worker` extra sits beside this interpreter, maybe not on PATH.
    bindir = str(Path(sys.executable).parent)
    if shutil.which("ninja") is None and (Path(bindir) / "ninja").exists():
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    source = SOURCE.read_bytes()
    # One build per source, torch version and torch install: the build embeds the torch
    # paths, and two environments sharing a directory would rebuild it for each other on
    # every start (each rebuild holding up every worker that waits for it).
    installed = f"{torch.__version__}:{os.path.dirname(os.path.abspath(torch.__file__))}"
    tag = hashlib.sha256(source + installed.encode()).hexdigest()[:12]
    name = f"zmqllm_decode_attention_{tag}"
    directory = build_dir() / name
    directory.mkdir(parents=True, exist_ok=True)
    # Built from a copy inside the build directory: the loader rebuilds whenever the
    # source path changes, so two checkouts on one machine would rebuild each other's
    # kernel on every start.
    copy = directory / SOURCE.name
    if not copy.exists() or copy.read_bytes() != source:
        staged = copy.with_name(f"{copy.name}.{os.getpid()}")
        staged.write_bytes(source)
        staged.replace(copy)
    with open(directory / "zmqllm.lock", "a+") as held:
        # flock dies with its process, unlike the lock file torch's loader leaves behind
        # when a builder is killed (every later load would then wait on it forever).
        deadline = time.monotonic() + BUILD_WAIT_S
        while True:
            try:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    log.warning("another process's kernel build did not finish; using PyTorch")
                    return None
                time.sleep(0.2)
        # Holding it, no other zmqllm process builds here: torch's lock is a dead one's.
        (directory / "lock").unlink(missing_ok=True)
        if not any(directory.glob(f"{name}*.so")):
            log.info(
                "building the compiled decode attention kernel (once)", directory=str(directory)
            )
        return _load(cpp_extension, name, copy, directory)


def _load(cpp_extension: ModuleType, name: str, copy: Path, directory: Path) -> ModuleType | None:
    try:
        module = cpp_extension.load(
            name=name,
            sources=[str(copy)],
            build_directory=str(directory),
            # The build runs on the machine that uses it: tune for its CPU. OpenMP
            # makes at::parallel_for use torch's threads (without it, it runs serially).
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a failed build: stay in Python
        log.warning(
            "compiled decode attention unavailable; using the PyTorch path",
            error=str(exc).splitlines()[-1][:300] if str(exc) else type(exc).__name__,
        )
        return None
    return module
