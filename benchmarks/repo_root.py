"""Importing this puts the checkout's root first on sys.path, for ``import testbed``.

testbed/ (the local cluster) is test scaffolding that is not installed with zmqllm, and
``python benchmarks/x.py`` puts only benchmarks/ on the path. First, so that zmqllm is this
checkout's too, whatever the environment has installed: a benchmark measures the tree it
is in. (compare_revisions.py measures older trees, so the modules it loads into them do
not import this.)
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
