"""One source for the release (setup.cfg's version, the package metadata) and one for the
wire (protocol.PROTOCOL_VERSION): both are read, never written twice."""

from __future__ import annotations

import configparser
import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

from zmqllm.bus.protocol import PROTOCOL_VERSION
from zmqllm.version import __version__

ROOT = Path(__file__).resolve().parents[1]


def setup_cfg_version() -> str:
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    return parser.get("metadata", "version")


def test_the_version_is_setup_cfgs_and_no_longer_the_skeletons() -> None:
    assert __version__ == setup_cfg_version()
    major, minor, *_ = (int(p) for p in re.findall(r"\d+", __version__))
    assert (major, minor) >= (0, 2)


def test_the_installed_metadata_agrees_when_installed() -> None:
    try:
        installed = version("zmqllm")
    except PackageNotFoundError:
        pytest.skip("zmqllm is not installed here (run from the checkout)")
    assert installed == __version__


def test_the_cli_prints_it() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "zmqllm.cli", "--version"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    assert out.strip() == f"zmqllm {__version__}"


def test_no_other_module_spells_a_version() -> None:
    # The release in setup.cfg only, the wire's in bus/protocol.py only.
    spelled = [
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "zmqllm").rglob("*.py")
        if re.search(r"^(__version__|PROTOCOL_VERSION)\s*=\s*['\"\d]", p.read_text(), re.M)
    ]
    assert spelled == ["zmqllm/bus/protocol.py"]
    assert isinstance(PROTOCOL_VERSION, int) and PROTOCOL_VERSION >= 1
