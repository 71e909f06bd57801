"""Where a pipeline worker's results go next, decided without I/O (as the broker's
``SessionTable.on_token`` is): the compute loop hands a result and what its session
says, and gets back what to send where; only the loop touches a socket or the stage.

A result's next hop is one of:

- here: on a route of one stage the broker names this worker, stage 0, as the last
  stage's ``next``: the next step is queued on this worker and the token, saying so
  (``stepped``), goes to the broker, which then sends no STEP;
- the peer link: an activation goes to the next stage, or (last stage) the next STEP
  to stage 0, worker to worker; the broker sees only the token;
- the broker, for everything else, and for a session whose peer link once failed
  (``PeerRoute.via_broker``), so that its messages stay in order.

Each result also carries its forward's group (``group_tags``): the outputs of one
forward bound for one next worker form a group, which that worker waits for in full.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections import Counter
from dataclasses import dataclass

from zmqllm.bus.messages import Activation, Message, Step, Token
from zmqllm.worker.peer_link import PeerRoute

__all__ = ["Routed", "group_tags", "route_result"]


@dataclass(frozen=True, slots=True)
class Routed:
    """What one result sends: ``ahead`` first, past the broker (queued on this worker
    when ``peer`` is "", else over the peer link to ``peer``); then the broker gets
    ``to_broker`` (None: nothing) if ``ahead`` went or there is none, else ``instead``."""

    to_broker: Message | None
    ahead: Step | Activation | None = None
    peer: str = ""
    instead: Message | None = None


def route_result(
    result: Token | Activation, identity: str, next_hop: str | None, link: PeerRoute | None
) -> Routed:
    """Where ``result`` (a token not yet ``stepped``, or an activation) goes, for a
    session whose results go to ``next_hop`` and whose peer links are ``link`` (None
    for both: the session is gone, and its result goes to the broker, which knows)."""
    # The peer link's endpoint, if this session's results go over it now.
    peer = link.next_peer if link is not None and not link.via_broker else ""
    if isinstance(result, Activation):
        return Routed(None, ahead=result, peer=peer, instead=result) if peer else Routed(result)
    if result.finish is not None or result.more:
        # The last token: the broker ends the session; or more of its pass follow, and
        # the pass's last token steps it: no step follows this one.
        return Routed(result)
    if next_hop == identity:
        return _stepping(result, peer="")  # here wins over any peer link
    return _stepping(result, peer) if peer else Routed(result)


def _stepping(token: Token, peer: str) -> Routed:
    """The next step goes ahead; the token says so, unless the step cannot go (then
    the broker sends the STEP, as on a route without peer links)."""
    step = Step.following(token, token.request_id)
    return Routed(dataclasses.replace(token, stepped=True), step, peer, instead=token)


def group_tags(hops: list[str | None], forward_id: str) -> list[tuple[str, int] | None]:
    """(group id, size) per output of one forward, from the next worker each goes to
    (None: a final token, in no group: the broker ends it, no step follows); the
    outputs bound for one worker share a group, named by the forward and that worker."""
    sizes = Counter(h for h in hops if h is not None)
    return [
        None if h is None else (f"{forward_id}-{zlib.crc32(h.encode()):08x}", sizes[h])
        for h in hops
    ]
