"""The release this is: one source, the package metadata (setup.cfg's ``version``).

It moves with every change that touches the wire: a broker refuses a worker whose
version differs (``Registry.refusal``), so mixed releases never share a route.
"""

from __future__ import annotations

import configparser
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

__all__ = ["__version__"]


def _version() -> str:
    # A source checkout (bin/* run with PYTHONPATH=the checkout) has setup.cfg beside the
    # package and may have an older release installed: the checkout's own file wins.
    setup_cfg = Path(__file__).resolve().parent.parent / "setup.cfg"
    if setup_cfg.is_file():
        parser = configparser.ConfigParser()
        parser.read(setup_cfg)
        if parser.get("metadata", "name", fallback="") == "zmqllm":
            return parser.get("metadata", "version")
    try:
        return version("zmqllm")
    except PackageNotFoundError:  # neither installed nor a checkout: a bare copy
        return "0+unknown"


__version__ = _version()
