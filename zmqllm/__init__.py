"""zmqllm: a Mistral LLM served as pipeline shards over a ZeroMQ bus."""
