"""The benchmarks: scripts that measure the tree they are in, and what they share.

Shared: ``http_client`` (the one streaming HTTP client and its per-request record),
``stats`` (percentiles, medians and ranges, tokens/s), ``paired`` (alternating rounds),
``report`` (JSON and PNG), ``links`` (a cluster across test hosts), ``process_cpu``,
``floor`` (the read bandwidth and GEMM rates a figure is held against).

Each script runs as ``python benchmarks/NAME.py`` or ``python -m benchmarks.NAME``.
Its first statement puts the checkout's root first on ``sys.path``: run as a file, only
benchmarks/ is on it, and ``benchmarks``, ``testbed`` (test scaffolding that is not
installed) and ``zmqllm`` must be this checkout's whatever the environment has
installed, since a benchmark measures the tree it is in.
"""
