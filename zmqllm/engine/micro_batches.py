"""Micro-batches in flight: how the sessions of a pipeline route move as groups.

With one group of sessions on a route of K stages, each stage waits while the others
compute. Stage 0 instead splits a route's sessions into K groups of about equal size
(``MicroBatches``, decided without sockets or tensors): each stage then forwards one
group while the others are elsewhere in the pipeline, as vLLM's pipeline parallelism
keeps one batch per stage in flight (GPipe's micro-batches, at decode time).

Every stage keeps a group together: the results of one forward bound for one next worker
carry ``(group id, size)``, and a stage that has seen part of a group waits a little for
the rest (``Arrivals``) instead of forwarding a fragment, since messages of one forward
arrive one session at a time.

Stage 0 decides each forward's share of a route's ready sessions:

- all of a route's sessions back here (at the start, or after a stage merged groups):
  the first of K parts runs now and the rest right after, one group per stage;
- otherwise at most ``ceil(sessions / K)`` run, oldest group first; a session left over
  forms a new group while fewer than K are elsewhere, and once K are, it waits for the
  next group to come back and joins it (balance after sessions finish), for at most
  ``hold_limit``;
- a prompt never waits: new sessions join the next forward that has room.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from zmqllm.bus.wire_types import SessionKey

__all__ = [
    "GROUP_WAIT_S",
    "HOLD_MAX_S",
    "MAX_GROUPS",
    "Arrivals",
    "Group",
    "Member",
    "MicroBatches",
]

# A stage waits for the rest of a group it has seen part of for at most this long after
# the last one came (a broker or gateway descheduled for a few ms must not split the
# batch; a member cancelled on its way never comes).
GROUP_WAIT_S = 0.025
MAX_GROUPS = 64
# The longest a left-over session waits to join the next group: a safety net, well
# above a forward of a stage (hold_limit scales with the stage's own forwards).
HOLD_MAX_S = 2.0


@dataclass
class Group:
    """The results of one forward of another stage bound for this one, seen in part."""

    size: int  # how many messages the group has
    arrived: int = 0  # how many of them came
    last: float = 0.0  # when the last of them came (monotonic)


class Arrivals:
    """The groups a stage has seen part of, by id, from the tags on its messages."""

    def __init__(self) -> None:
        self.groups: dict[str, Group] = {}

    def note(self, group: tuple[str, int] | None, now: float) -> None:
        """Count a STEP or ACTIVATION towards its group (None: untagged, no group)."""
        if group is None:
            return
        gid, size = group
        g = self.groups.get(gid)
        if g is None:
            if len(self.groups) >= MAX_GROUPS:  # groups that never completed (cancels)
                self.groups = {k: v for k, v in self.groups.items() if v.last + GROUP_WAIT_S > now}
                if len(self.groups) >= MAX_GROUPS:  # a flood of live ones: forget them all
                    self.groups.clear()
            g = self.groups[gid] = Group(size)
        g.arrived += 1
        g.last = now
        if g.arrived >= g.size:
            del self.groups[gid]

    def wait(self, now: float) -> float:
        """Seconds until every group seen in part is complete or given up (0: none)."""
        wait = 0.0
        for g in self.groups.values():
            wait = max(wait, g.last + GROUP_WAIT_S - now)
        return wait


@dataclass(frozen=True, slots=True)
class Member:
    """One session of a route at stage 0, as the planner sees it."""

    id: SessionKey
    group: int  # the stage-0 forward it last went in (-1: none yet)
    # Since when it has work here: its decode step came, or its prompt (the rest of it)
    # could run; None: none is here.
    ready_at: float | None
    prompt: bool = False  # that work is prompt tokens


@dataclass(frozen=True, slots=True)
class Share:
    """A route's share of the next forward: the sessions to run (in order), or, when
    none, how long to wait for the group that comes back next (0: nothing to run)."""

    run: tuple[SessionKey, ...]
    wait: float = 0.0


class MicroBatches:
    """Stage 0's grouping policy. ``groups``: 0 = one group per stage of each route, 1 =
    every session in one group (stages sharing cores take turns: one bigger batch is
    cheaper than two), N = at most N."""

    def __init__(self, groups: int = 0) -> None:
        self.groups = groups

    def wanted(self, stages: int) -> int:
        """Groups in flight for a route of ``stages`` stages."""
        return max(1, stages if self.groups == 0 else min(self.groups, stages))

    def share(self, members: Sequence[Member], stages: int, now: float, hold_limit: float) -> Share:
        """Which of one route's ``members`` (every session of the route open here)
        the next forward takes."""
        # Oldest first: a group that came back together stays together, and neither
        # prompts nor steps wait behind work that came after them.
        ready = sorted((m for m in members if m.ready_at is not None), key=_since)
        if not ready:
            return Share(())
        k = min(self.wanted(stages), len(members))
        if k <= 1:
            return Share(tuple(m.id for m in ready))
        cap = math.ceil(len(members) / k)
        elsewhere = {m.group for m in members if m.ready_at is None and m.group >= 0}
        if len(elsewhere) >= k and len(ready) < cap and not any(m.prompt for m in ready):
            # K groups are elsewhere already: these join the next one back.
            left = _since(ready[0]) + hold_limit - now
            if left > 0:
                return Share((), left)
        take = math.ceil(len(ready) / k) if not elsewhere else min(len(ready), cap)
        return Share(tuple(m.id for m in ready[:take]))

    @staticmethod
    def hold_limit(last_forward_s: float) -> float:
        """How long a left-over session may wait for the next group: a few of this
        stage's forwards (the other groups are that far away), at least GROUP_WAIT_S."""
        return min(HOLD_MAX_S, max(GROUP_WAIT_S, 3 * last_forward_s) + GROUP_WAIT_S)


def _since(m: Member) -> float:
    return m.ready_at if m.ready_at is not None else 0.0
