"""``GenerateRequest``: one generation, as the gateway builds it once from an HTTP body.

The same object goes through every layer without being taken apart: the gateway plans it,
``BrokerClient.generate`` takes it whole, a failover replay derives the next attempt from
it with ``dataclasses.replace`` (the history as the prompt, the budget left, sampling
from the step reached), and ``zmqllm.client.streams.open_frames`` turns it into the OPEN.
Plain data, no sockets: the gateway imports it without ZeroMQ.
"""

from __future__ import annotations

from dataclasses import dataclass

from zmqllm.bus.sampling_params import SamplingParams

__all__ = ["GenerateRequest"]


@dataclass(frozen=True)
class GenerateRequest:
    """What one session is asked to generate."""

    request_id: str  # the HTTP request's id: logs of every process carry it
    prompt: tuple[int, ...]  # token ids
    max_tokens: int  # the most tokens to generate (the OPEN's budget)
    sampling: SamplingParams
    # Token ids that end the generation (the model's EOS, unless the request ignores it).
    stop_ids: tuple[int, ...] = ()
    model: str = ""  # the model's name on the bus; "" for the broker's only one
    # The session id of this attempt; "" lets the client draw a fresh one. A replay names
    # each attempt itself.
    session: str = ""
    # Stop strings: the gateway cuts the text at them (it detokenizes); never on the wire.
    stops: tuple[str, ...] = ()
    # A replay's: the build of the route its stream started on (as the first token said
    # it); the broker routes it only onto workers of that build. (): any route.
    route_build: tuple[str, ...] = ()
    # False: the route's last stage makes no proposals for it (speculative decoding).
    speculative: bool = True

    @property
    def kv_tokens(self) -> int:
        """The KV cache the session may fill: its prompt and its whole budget."""
        return len(self.prompt) + self.max_tokens
