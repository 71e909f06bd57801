"""Where a pipeline worker's results go (worker.routing): a pure function of the result
and what its session says, checked without sockets, a stage or torch."""

from __future__ import annotations

import numpy as np
import pytest

from zmqllm.bus.messages import Activation, Finish, Step, Token
from zmqllm.bus.wire_types import Payload
from zmqllm.worker.peer_link import PeerRoute
from zmqllm.worker.routing import Routed, group_tags, route_result

ME = "w-me-0-4-abc123"
NEXT = "tcp://127.0.0.1:5999"
GROUP = ("g-1", 2)


def token(finish: Finish | None = None) -> Token:
    return Token(
        session="s1", attempt=1, request_id="r1", step=7, token=42, finish=finish, group=GROUP
    )


def activation() -> Activation:
    hidden = Payload(np.zeros((1, 4), np.float32), "float32")
    return Activation(session="s1", attempt=1, request_id="r1", step=3, final=True, hidden=hidden)


def peers(via_broker: bool = False, next_peer: str = NEXT) -> PeerRoute:
    return PeerRoute(next_peer, prev="w-prev", prev_key="", via_broker=via_broker)


def test_a_route_of_one_stage_queues_the_next_step_here() -> None:
    tok = token()
    routed = route_result(tok, ME, next_hop=ME, link=None)
    assert routed.peer == ""  # here, not over a link
    assert routed.ahead == Step(
        session="s1", attempt=1, request_id="r1", step=8, token=42, group=GROUP
    )
    assert isinstance(routed.to_broker, Token) and routed.to_broker.stepped
    # Not queued: the token says nothing and the broker sends the STEP.
    assert routed.instead == tok and not tok.stepped


def test_stepping_here_wins_over_a_peer_link() -> None:
    routed = route_result(token(), ME, next_hop=ME, link=peers())
    assert routed.peer == "" and isinstance(routed.ahead, Step)


def test_the_last_stage_steps_stage_0_over_its_peer_link() -> None:
    tok = token()
    routed = route_result(tok, ME, next_hop="w-stage0", link=peers())
    assert routed.peer == NEXT
    assert isinstance(routed.ahead, Step) and (routed.ahead.step, routed.ahead.token) == (8, 42)
    assert routed.to_broker == Token(
        session="s1", attempt=1, request_id="r1", step=7, token=42, group=GROUP, stepped=True
    )
    assert routed.instead == tok  # the link cannot take it: the broker steps it


def test_an_activation_goes_over_the_peer_link_and_not_to_the_broker() -> None:
    act = activation()
    routed = route_result(act, ME, next_hop="w-stage1", link=peers())
    assert routed == Routed(None, ahead=act, peer=NEXT, instead=act)


@pytest.mark.parametrize(
    "link",
    [None, peers(via_broker=True), peers(next_peer="")],
    ids=["no peer link", "link failed before", "no next peer"],
)
def test_without_a_usable_peer_link_everything_goes_to_the_broker(link: PeerRoute | None) -> None:
    tok, act = token(), activation()
    assert route_result(tok, ME, next_hop="w-stage0", link=link) == Routed(tok)
    assert route_result(act, ME, next_hop="w-stage1", link=link) == Routed(act)


@pytest.mark.parametrize("link", [None, peers()], ids=["broker", "peer link"])
def test_a_last_token_goes_to_the_broker_alone(link: PeerRoute | None) -> None:
    last = token(Finish.LENGTH)
    # Even on a route of one stage: no step follows a finished session.
    assert route_result(last, ME, next_hop=ME, link=link) == Routed(last)


def test_a_session_closed_meanwhile_goes_to_the_broker() -> None:
    tok = token()
    assert route_result(tok, ME, next_hop=None, link=None) == Routed(tok)


def test_routing_sends_nothing_and_changes_nothing() -> None:
    link = peers()
    before = PeerRoute(link.next_peer, link.prev, link.prev_key, link.via_broker)
    route_result(activation(), ME, next_hop="w-stage1", link=link)
    assert link == before


def test_outputs_for_one_next_worker_share_a_group() -> None:
    a, b, final, c, gone = group_tags(["w1", "w2", None, "w1", ""], "f-1")
    assert final is None
    assert a == c and a is not None and a[1] == 2 and a[0].startswith("f-1-")
    assert b is not None and b[1] == 1 and b[0] != a[0]
    assert gone is not None and gone[1] == 1 and gone[0] not in (a[0], b[0])
    again = group_tags(["w1"], "f-2")[0]
    assert again is not None and again[0] != a[0]  # another forward, another group


@pytest.mark.parametrize("next_hop", [ME, "w-stage0"])
def test_a_token_with_more_of_its_pass_to_follow_goes_to_the_broker_only(next_hop: str) -> None:
    # Speculative decoding: the pass's last token steps the session, with its proposals.
    more = Token(session="s1", attempt=1, request_id="r1", step=7, token=42, more=True)
    assert route_result(more, ME, next_hop=next_hop, link=peers()) == Routed(more)
    last = Token(session="s1", attempt=1, request_id="r1", step=8, token=43, draft=(44, 45))
    routed = route_result(last, ME, next_hop=next_hop, link=peers())
    assert isinstance(routed.ahead, Step) and routed.ahead.draft == (44, 45)
    assert routed.ahead.step == 9
