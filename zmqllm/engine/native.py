"""The optional compiled extension (csrc/): batched decode attention, the fused
per-layer steps of a decode forward (RMSNorm, rotary embedding, silu(gate) * up)
and the single-row matrix-vector product of a single stream.

Built on first use with torch's C++ extension loader (a C++ compiler and ninja
are needed) into ``$ZMQLLM_HOME/kernels/<key>``, where the key is a digest of
what determines the binary: the sources, the compiler flags, the compiler, the
torch build, the Python ABI and the CPU (``-march=native``, or the target named by
``ZMQLLM_NATIVE_MARCH``). Not the checkout's
or the virtual environment's path: every checkout and venv with the same torch
shares one build. A built module is imported straight from its ``.so`` (no
ninja check, which would see another venv's include paths and rebuild). Where it
cannot be built, or with ``ZMQLLM_NATIVE=0``, the engine keeps its pure-PyTorch
path: same results to float32 rounding, slower.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

from zmqllm.config.paths import zmqllm_home
from zmqllm.log import KERNELS_BUILDING, KERNELS_BUILT, get_logger

log = get_logger("zmqllm.engine.native")

CSRC = Path(__file__).parent / "csrc"


def sources(csrc: Path) -> tuple[Path, ...]:
    """Every C++ file of a csrc/ folder: one per kernel and instruction set, the bindings."""
    return tuple(sorted(csrc.glob("*.cpp")))


def headers(csrc: Path) -> tuple[Path, ...]:
    return tuple(sorted(csrc.glob("*.h")))


# Which kernel of an instruction set runs is chosen when these compile (csrc/quant.h):
# every file is compiled, and one for a set the CPU lacks compiles to nothing.
SOURCES = sources(CSRC)
HEADERS = headers(CSRC)
# OpenMP makes at::parallel_for use torch's threads (without it, it runs serially).
# -fno-trapping-math: no code here reads floating-point exception flags, and without it
# GCC vectorizes no loop with a comparison in it (the clamped exp of the softmax and of
# silu stayed scalar); results are the same, IEEE operation for operation.
CFLAGS = ("-O3", "-fopenmp", "-fno-trapping-math")
# The build runs on the machine that uses it and is tuned for its CPU (-march=native).
# ZMQLLM_NATIVE_MARCH names another target: x86-64-v3 builds what an AVX2-only CPU runs,
# x86-64-v4 an AVX-512 one without BF16, VNNI or AMX; for checking those paths here.
MARCH_ENV = "ZMQLLM_NATIVE_MARCH"
_MARCH_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-_.")
LDFLAGS = ("-fopenmp",)
NAME = "zmqllm_native"
_lock = threading.Lock()
_state: dict[str, ModuleType | None] = {}
# Longest wait for another process's build of the same kernel; past it, the PyTorch path.
BUILD_WAIT_S = 900.0
_BUILD_SCRIPT = """
import json, sys
from torch.utils import cpp_extension
name, sources, directory, cflags, ldflags = json.loads(sys.argv[1])
cpp_extension.load(name=name, sources=sources, build_directory=directory,
                   extra_cflags=cflags, extra_ldflags=ldflags, verbose=False)
"""


def march() -> str:
    """The -march the kernels are built for: ``native`` unless ZMQLLM_NATIVE_MARCH says."""
    value = os.environ.get(MARCH_ENV, "").strip().lower() or "native"
    if not set(value) <= _MARCH_CHARS:
        raise ValueError(f"{MARCH_ENV}={value!r}: not a compiler target name")
    return value


def compile_flags() -> list[str]:
    return [*CFLAGS, f"-march={march()}"]


def enabled() -> bool:
    return os.environ.get("ZMQLLM_NATIVE", "1").lower() not in ("0", "false", "no", "off")


def build_root() -> Path:
    return zmqllm_home() / "kernels"


def _compiler() -> str:
    """The C++ compiler's identity (its version line); empty if it cannot be run."""
    cxx = os.environ.get("CXX", "c++")
    try:
        done = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return f"{cxx}:{done.stdout.partition(chr(10))[0]}"


def _cpu() -> str:
    """What ``-march=native`` sees: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    wanted = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(wanted))


def cache_key() -> str:
    """A digest of everything the binary depends on, and nothing path-like."""
    h = hashlib.sha256()
    for src in (*SOURCES, *HEADERS):
        h.update(src.name.encode() + b"\0" + src.read_bytes() + b"\0")
    parts = (
        " ".join(compile_flags()),
        " ".join(LDFLAGS),
        _compiler(),
        torch.__version__,
        str(torch.version.git_version),
        str(torch.compiled_with_cxx11_abi()),
        str(sysconfig.get_config_var("EXT_SUFFIX")),
        sys.implementation.cache_tag or "",
        platform.machine(),
        _cpu(),
    )
    h.update("\0".join(parts).encode())
    return h.hexdigest()[:16]


def load() -> ModuleType | None:
    """The compiled module, building it if needed; None where it cannot be had
    (the reason is logged once)."""
    with _lock:
        if "module" not in _state:
            _state["module"] = _load_or_build() if enabled() else None
        return _state["module"]


def use_matrix_units(on: bool, int8_activations: bool = False) -> str:
    """Whether the quantized products of several rows use the CPU's matrix units in this
    process (csrc/quant_bf16.cpp and quant_amx.cpp: bfloat16 on AMX or AVX512_BF16;
    csrc/quant_codes.cpp: int8 and int4 codes as exact bfloat16 on AVX512_BF16) and, with
    ``int8_activations``, its 8-bit dot products (csrc/quant_vnni.cpp: AVX-512 VNNI), and
    which: e.g. "avx512_vnni,amx", or "" (off, or the kernel or the units missing). Linux
    hands out AMX's tile state only on request; the kernel asks, and oneDNN falls back to
    AVX512_BF16 where it is refused (some VMs), which the name says."""
    module = load()
    if module is None:
        return ""
    module.set_matrix_units(on, int8_activations)
    return str(module.matrix_units())


def import_built(path: Path) -> ModuleType:
    """The compiled module at ``path`` (a built ``.so``), imported as it is."""
    spec = importlib.util.spec_from_file_location(NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_or_build() -> ModuleType | None:
    directory = build_root() / cache_key()
    built = directory / f"{NAME}.so"
    try:
        if built.exists():
            return import_built(built)
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / "build.lock", "a+") as held:
            # flock dies with its process, unlike the lock file torch's loader leaves
            # behind when a builder is killed (every later load would wait on it).
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
            if not built.exists():  # another process may have built it while we waited
                _build(directory, built)
            return import_built(built)
    except Exception as exc:  # no compiler, no ninja, a failed build: stay in Python
        log.warning(
            "compiled kernels unavailable; using the PyTorch path",
            error=str(exc).splitlines()[-1][:300] if str(exc) else type(exc).__name__,
        )
        return None


def _build(directory: Path, built: Path, csrc: Path = CSRC) -> None:
    """Compile the sources in ``csrc`` in a scratch folder, then move the module into
    place in one rename: a ``.so`` at ``built`` is always a whole one."""
    # ninja from the `worker` extra sits beside this interpreter, maybe not on PATH.
    bindir = str(Path(sys.executable).parent)
    if shutil.which("ninja") is None and (Path(bindir) / "ninja").exists():
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    scratch = directory / "build"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    copies = []
    # Copies, so the build files name no checkout's path; csrc's own files, which for an
    # older revision's folder (build_from) need not be this checkout's.
    for src in (*sources(csrc), *headers(csrc)):
        copy = scratch / src.name
        copy.write_bytes(src.read_bytes())
        if src.suffix == ".cpp":
            copies.append(str(copy))
    log.info(
        f"{KERNELS_BUILDING}: once per source, torch, compiler and CPU (1-2 minutes on 2 cores)",
        directory=str(directory),
    )
    t0 = time.perf_counter()
    # In a child process: torch's loader imports what it builds, from the scratch
    # folder; this process then imports the module once, from its final place.
    args = json.dumps([NAME, copies, str(scratch), compile_flags(), list(LDFLAGS)])
    done = subprocess.run(
        [sys.executable, "-c", _BUILD_SCRIPT, args],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-20:]
        raise RuntimeError("kernel build failed: " + " | ".join(tail))
    os.replace(scratch / f"{NAME}.so", built)
    log.info(KERNELS_BUILT, seconds=round(time.perf_counter() - t0, 1))
    shutil.rmtree(scratch, ignore_errors=True)


def build_from(csrc: Path, directory: Path) -> Path:
    """Build the kernels whose sources are in ``csrc`` (every ``*.cpp`` and ``*.h`` there,
    e.g. an older revision's csrc/) into ``directory``, outside the cache; the module's
    path."""
    directory.mkdir(parents=True, exist_ok=True)
    built = directory / f"{NAME}.so"
    _build(directory, built, csrc)
    return built
