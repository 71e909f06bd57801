"""Prompt lookup's proposals and the adaptive draft length, without a model."""

from __future__ import annotations

from zmqllm.engine.prompt_lookup import (
    BUSY_MIN_NGRAM,
    MISSES_BEFORE_PAUSE,
    PAUSE_MIN,
    DraftLength,
    PromptLookup,
    Proposer,
    SpecStats,
    resolved_mode,
)


def test_the_tokens_after_the_last_occurrence_of_the_suffix_are_proposed() -> None:
    lookup = PromptLookup([1, 2, 3, 4, 5, 9, 1, 2, 3])
    # "1 2 3" occurred before, followed by "4 5 9".
    assert lookup.propose(3) == [4, 5, 9]
    assert lookup.propose(1) == [4]
    assert lookup.propose(0) == []


def test_the_longest_ngram_wins_then_its_most_recent_occurrence() -> None:
    # "2 3" is followed by 7 once and, later, by 8; "1 2 3" only by 7.
    lookup = PromptLookup([1, 2, 3, 7, 0, 2, 3, 8, 5, 1, 2, 3])
    assert lookup.propose(2) == [7, 0]
    shorter = PromptLookup([1, 2, 3, 7, 0, 2, 3, 8, 5, 4, 2, 3])
    assert shorter.propose(2) == [8, 5]  # "4 2 3" never occurred: the latest "2 3"


def test_a_busy_forward_proposes_from_longer_matches_only() -> None:
    assert BUSY_MIN_NGRAM == 3
    # Only "2 3" occurred before (then 8): a match of 2 tokens.
    two = [4, 2, 3, 8, 5, 2, 3]
    assert Proposer.of(two, 4).propose(7, 64, 64) == (8, 5, 2, 3)
    assert Proposer.of(two, 4).propose(7, 64, 64, busy=True) == ()
    # "1 2 3" occurred before (then 7): a match of 3, proposed either way.
    three = [1, 2, 3, 7, 0, 1, 2, 3]
    assert Proposer.of(three, 2).propose(8, 64, 64, busy=True) == (7, 0)


def test_no_proposal_without_an_earlier_ngram() -> None:
    assert PromptLookup([]).propose(4) == []
    assert PromptLookup([5]).propose(4) == []
    assert PromptLookup([1, 2, 3, 4]).propose(4) == []
    # A single token seen before is not enough (a 1-gram matches any text's common tokens).
    assert PromptLookup([1, 9, 1]).propose(4) == []


def test_proposals_follow_the_history_as_it_grows() -> None:
    lookup = PromptLookup([4, 5, 6, 7])
    lookup.append(4)
    assert lookup.propose(2) == []
    lookup.append(5)
    assert lookup.propose(2) == [6, 7]
    lookup.extend([6, 7, 4, 5])
    # The latest "7 4 5" is the one 4 tokens back: a loop of 4, proposed as going on.
    assert lookup.propose(8) == [6, 7, 4, 5, 6, 7, 4, 5]


def test_a_loop_shorter_than_k_is_proposed_as_repeating() -> None:
    lookup = PromptLookup([3, 3, 3])
    assert lookup.propose(4) == [3, 3, 3, 3]
    cycle = PromptLookup([1, 8, 9, 8, 9])
    assert cycle.propose(5) == [8, 9, 8, 9, 8]
    # Far enough back, the tokens that followed are proposed as they were.
    assert PromptLookup([1, 2, 3, 4, 5, 6, 1, 2]).propose(3) == [3, 4, 5]


def test_draft_length_grows_while_all_are_accepted_and_shrinks_on_misses() -> None:
    length = DraftLength(most=6, k=2)
    length.passed(2, 2, 3)
    assert length.allowed() == 3
    length.passed(3, 3, 4)
    length.passed(4, 4, 5)
    length.passed(5, 5, 6)
    assert length.allowed() == 6  # never past most
    length.passed(6, 1, 2)
    assert length.allowed() == 2  # as many as were accepted, and one more


def test_where_rows_are_free_the_window_stays_full_but_misses_still_pause() -> None:
    """A pass whose round trip dwarfs its forward (links: LINK_BOUND) keeps the whole
    window after a partial acceptance; proposals that all fail still pause it."""
    length = DraftLength(most=6)
    length.passed(6, 1, 2, free=True)
    assert length.allowed() == 6
    length.passed(6, 1, 2)
    assert length.allowed() == 2  # not free: as many as were accepted, and one more
    for _ in range(MISSES_BEFORE_PAUSE):
        length.passed(length.allowed(), 0, 1, free=True)
    assert length.allowed() == 0


def test_draft_length_pauses_after_misses_and_pauses_longer_each_time() -> None:
    length = DraftLength(most=4)
    for _ in range(MISSES_BEFORE_PAUSE):
        assert length.allowed() > 0
        length.passed(length.allowed(), 0, 1)
    assert length.allowed() == 0
    for _ in range(PAUSE_MIN - 1):
        length.passed(0, 0, 1)
        assert length.allowed() == 0
    length.passed(0, 0, 1)
    assert length.allowed() > 0  # proposals are tried again
    for _ in range(MISSES_BEFORE_PAUSE):
        length.passed(length.allowed(), 0, 1)
    assert length.pause == 2 * PAUSE_MIN
    # Tokens from a pass that proposed nothing still count down the pause.
    length.passed(0, 0, 2 * PAUSE_MIN)
    length.passed(1, 1, 2)  # a success resets the backoff
    assert length.backoff == PAUSE_MIN


def test_proposer_counts_and_bounds_its_proposals() -> None:
    stats = SpecStats()
    p = Proposer.of([1, 2, 3, 4, 5, 6, 7, 8, 1, 2], most=4)
    assert p.propose(next_step=1, max_tokens=100, room=100) == (3, 4, 5, 6)
    assert p.expect == 1
    # Never past the session's last step, nor the rows its cache has left.
    assert p.propose(next_step=97, max_tokens=100, room=100) == (3, 4)
    assert p.propose(next_step=1, max_tokens=100, room=1) == (3,)
    p.propose(1, 100, 100)
    p.kept([3, 4, 9], proposed=4, stats=stats)  # 2 accepted, then its own token
    assert p.lookup.tokens[-3:] == [3, 4, 9]
    assert (stats.proposed, stats.accepted, stats.passes, stats.tokens) == (4, 2, 1, 3)
    p.kept([1], proposed=0, stats=None)  # the prompt's pass is not counted
    assert stats.passes == 1
    assert stats.figures()["spec_tokens_per_pass"] == 3.0


def test_auto_is_lookup_only_where_a_pass_keeps_each_row_s_bits() -> None:
    assert resolved_mode("auto", exact_rows=True) == "lookup"
    assert resolved_mode("auto", exact_rows=False) == "off"
    for mode in ("off", "lookup", "draft"):  # said explicitly: as said
        assert resolved_mode(mode, exact_rows=False) == mode == resolved_mode(mode, True)
