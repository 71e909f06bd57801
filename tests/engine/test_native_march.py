"""Kernels built for another CPU than this one (``ZMQLLM_NATIVE_MARCH``): what an AVX2-only
machine compiles (x86-64-v3), checked for exactness here, so a change that breaks only
those paths fails CI on any machine of this project's kinds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from zmqllm.engine import native

pytestmark = pytest.mark.torch

REPO = Path(__file__).resolve().parents[2]
AVX2_ONLY = "x86-64-v3"


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def test_the_target_is_this_cpu_unless_one_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(native.MARCH_ENV, raising=False)
    assert native.march() == "native"
    assert "-march=native" in native.compile_flags()
    key = native.cache_key()
    monkeypatch.setenv(native.MARCH_ENV, AVX2_ONLY)
    assert "-march=x86-64-v3" in native.compile_flags()
    assert native.cache_key() != key  # its own build, beside this CPU's
    monkeypatch.setenv(native.MARCH_ENV, "x86-64-v3 -fplugin=/tmp/p.so")
    with pytest.raises(ValueError, match="not a compiler target name"):
        native.compile_flags()


@pytest.mark.skipif(
    "avx512f" not in _cpu_flags(),
    reason="this CPU builds the AVX2 kernels natively: the rest of the suite checks them",
)
def test_an_avx2_only_build_passes_the_kernel_tests() -> None:
    """The int4/int8 products, attention and fused steps of an x86-64-v3 build against
    their references (tests/engine/test_quant.py, test_native.py, test_decode_attention.py,
    test_kv_dtype.py), in a child process
    that builds it (once per source, like any build: 2-3 minutes on 2 cores)."""
    env = {**os.environ, native.MARCH_ENV: AVX2_ONLY}
    tests = [
        f"tests/engine/test_{name}.py"
        for name in ("quant", "native", "decode_attention", "kv_dtype")
    ]
    args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "torch", *tests]
    done = subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " skipped" not in done.stdout, done.stdout[-2000:]
    probe = (
        "from zmqllm.engine import native; k = native.load(); "
        "print(k is not None, k.bf16_built(), k.vnni_built(), repr(k.matrix_units()))"
    )
    shown = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True
    )
    # Built, with neither the bfloat16 matrix-unit nor the VNNI path: AVX2's kernels ran.
    assert shown.stdout.split() == ["True", "False", "False", "''"], shown.stdout + shown.stderr
