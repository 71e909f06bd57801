"""zmqllm: a Mistral LLM served as pipeline shards over a ZeroMQ bus."""

__version__ = "0.1.0"
PROTOCOL_VERSION = 1
