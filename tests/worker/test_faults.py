"""Fault counters and their rate-limited log."""

from __future__ import annotations

from typing import Any

import pytest

import zmqllm.bus.sockets as bus
from zmqllm.bus.sockets import describe
from zmqllm.worker.faults import FAULT_REASONS, Faults


class Recorder:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.lines.append((event, fields))


def fail_with(secret: str) -> BaseException:
    try:
        raise ValueError("x" * 500)
    except ValueError as exc:
        return exc


def test_every_fault_is_counted_but_only_a_few_lines_a_second_are_logged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [100.0]
    monkeypatch.setattr(bus.time, "monotonic", lambda: now[0])
    log = Recorder()
    faults = Faults(log, lines_per_second=3)  # type: ignore[arg-type]
    for _ in range(1000):
        faults.report("malformed", "bad message")
    faults.report("internal", "boom", fail_with("prompt text"), session="s/0")
    assert faults.count("malformed") == 1000
    # Per reason: a flood of one does not hide another.
    assert [f["reason"] for _, f in log.lines] == ["malformed"] * 3 + ["internal"]
    event, fields = log.lines[-1]
    assert (event, fields["session"]) == ("boom", "s/0")
    assert fields["error"].startswith("ValueError: xxx")
    now[0] += 1.5  # the next second: the lines left out are said to be
    faults.report("malformed", "bad message")
    assert log.lines[-1][1]["suppressed_before"] == 997
    load = faults.heartbeat_figures()
    assert set(load) == {f"fault_{r}" for r in FAULT_REASONS}
    assert (load["fault_malformed"], load["fault_internal"], load["fault_unsent"]) == (1001, 1, 0)


def test_an_exception_is_described_without_locals_or_its_whole_message() -> None:
    out = describe(fail_with("the secret prompt"))
    assert out["error"].startswith("ValueError: xxx")
    assert len(out["error"]) < 250
    assert out["where"].startswith("test_faults.py:")
    assert "secret" not in repr(out)


def test_every_fault_counter_can_ride_the_heartbeat() -> None:
    from zmqllm.bus.figure_keys import FIGURE_KEYS

    assert {f"fault_{r}" for r in FAULT_REASONS} <= FIGURE_KEYS
