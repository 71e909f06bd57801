"""What the engine's tests share: the compiled kernels, built once per session."""

from __future__ import annotations

import os
from types import ModuleType

import pytest


@pytest.fixture(scope="session")
def kernel() -> ModuleType:
    """The compiled kernels (zmqllm/engine/csrc); CI must build them, elsewhere a machine
    without a C++ toolchain skips what needs them."""
    pytest.importorskip("torch")
    from zmqllm.engine import native

    module = native.load()
    if module is None:
        if os.environ.get("CI"):
            pytest.fail("the compiled kernels must build in CI (compiler and ninja)")
        pytest.skip("no C++ toolchain here: the kernels cannot be built")
    return module
