"""Test and benchmark scaffolding: local clusters, network namespaces, link relays.

Not installed with zmqllm; tests and benchmarks import it from the repository root.
"""
