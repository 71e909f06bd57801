"""What every kind of worker process does around its turns: signals, the loop, exit codes.

SIGTERM drains (no new sessions; exit once the running ones finish), SIGINT or a second
SIGTERM stops at once. Each turn is isolated: one that raises is reported and the loop
goes on. A refusal by the broker exits with status 3, a dead broker link with 1.
"""

from __future__ import annotations

import time
from typing import Any

from zmqllm.log import get_logger
from zmqllm.worker.broker_link import LinkLost, WorkerRefused
from zmqllm.worker.faults import Faults

__all__ = ["TURN_FAILED_PAUSE_S", "WorkerLoop"]

log = get_logger("zmqllm.worker")

TURN_FAILED_PAUSE_S = 0.01  # a turn that raised is not retried in a tight loop


class WorkerLoop:
    """Subclasses set ``faults`` and define ``_turn``, ``sessions`` and ``close``."""

    draining = False
    _stop = False
    faults: Faults

    def sessions(self) -> int:
        """Sessions still running here (draining ends when none is left)."""
        raise NotImplementedError

    def _turn(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def on_sigterm(self, *_: Any) -> None:
        if self.draining:
            self._stop = True
        else:
            self.draining = True
            log.info(
                "draining: no new sessions; exiting when the running ones finish",
                sessions=self.sessions(),
            )

    def on_sigint(self, *_: Any) -> None:
        self._stop = True

    def run_turns(self) -> int:
        """Turn until stopped or drained; the process's exit status."""
        try:
            while not self._stop:
                try:
                    self._turn()
                except (WorkerRefused, LinkLost):
                    raise
                except Exception as exc:  # the loop outlives whatever one turn meets
                    self.faults.report("internal", "worker turn failed", exc)
                    time.sleep(TURN_FAILED_PAUSE_S)
                if self.draining and not self.sessions():
                    log.info("drained; leaving")
                    self._stop = True
        except WorkerRefused as exc:
            log.error("refused by the broker", reason=str(exc))
            return 3
        except LinkLost as exc:
            log.error("leaving", reason=str(exc))
            return 1
        finally:
            self.close()
        return 0
