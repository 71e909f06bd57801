"""Self-signed TLS certificates for tests, made with the ``openssl`` command line tool.

(The ``cryptography`` package is not a dependency; the CLI is on every machine that runs
the tests, and a test that cannot find it is skipped, not failed.)
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

__all__ = ["openssl", "self_signed"]


def openssl() -> str:
    """The openssl command; the test is skipped where there is none."""
    found = shutil.which("openssl") or shutil.which("openssl", path="/usr/bin")
    if found is None:
        pytest.skip("the openssl command line tool is not installed")
    return found


def self_signed(directory: Path, name: str = "gateway", ip: str = "127.0.0.1") -> tuple[Path, Path]:
    """A certificate for ``ip`` (subjectAltName IP, as clients check) and its unencrypted
    key, written under ``directory``: (cert.pem, key.pem). The certificate is its own CA."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / f"{name}-cert.pem", directory / f"{name}-key.pem"
    subprocess.run(
        [
            openssl(),
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "2",
            "-subj",
            f"/CN={ip}",
            "-addext",
            f"subjectAltName=IP:{ip}",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    return cert, key
