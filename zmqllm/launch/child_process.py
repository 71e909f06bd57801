"""The one way zmqllm starts a child process: ``python -m zmqllm.cli ROLE`` (or any command)
as the leader of a process group of its own, writing to a private log file, dying with its
parent; then signalled as a group, waited for, and read back through the tail of its log.

`zmqllm up` (``launcher.py``) and the tests' and benchmarks' local clusters
(``testbed/cluster.py``) both start their processes here, so a child behaves the same
under both: a Ctrl-C in the terminal reaches only the process that started it, a signal
sent to a child reaches anything that child started, no child outlives a parent that
was SIGKILLed while it held the ports, and every child starts with SIGINT and SIGTERM at
their defaults, whatever the parent inherited. Torch-free.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

from zmqllm.log import printable

__all__ = [
    "LOG_DIR_MODE",
    "LOG_FILE_MODE",
    "ChildProcess",
    "describe_exit",
    "open_private_log",
    "private_log_dir",
    "spawn",
    "tail",
]

LOG_DIR_MODE = 0o700  # owner only: see private_log_dir
LOG_FILE_MODE = 0o600
TAIL_LINES = 20
_PR_SET_PDEATHSIG = 1
# The signals a stop arrives by (the launcher sends SIGINT, a parent's death SIGTERM).
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


# --- log files ---------------------------------------------------------------------------


def private_log_dir(directory: Path) -> None:
    """Make the log folder, readable by its owner only.

    Logs name requests, routes and errors (at debug level, more): other users of the
    machine have no business reading them. A shared folder (sticky, like /tmp) is left as
    it is; the files in it are private anyway.
    """
    directory.mkdir(parents=True, exist_ok=True, mode=LOG_DIR_MODE)
    mode = directory.stat().st_mode
    if not mode & stat.S_ISVTX and stat.S_IMODE(mode) & (stat.S_IRWXG | stat.S_IRWXO):
        directory.chmod(LOG_DIR_MODE)


def open_private_log(path: Path, append: bool = False) -> BinaryIO:
    """A log file for writing, created 0600 whatever the umask: fresh, or (``append``)
    continued after what an earlier run of the same child wrote."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    fd = os.open(path, flags, LOG_FILE_MODE)
    os.fchmod(fd, LOG_FILE_MODE)  # the file may have existed with a wider mode
    return os.fdopen(fd, "ab" if append else "wb")


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of a log, or a note saying there are none; control
    characters escaped, as it is printed to a terminal and a child's last words may quote
    a peer or a client (a crash's message, a library's line)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(printable(line) for line in text.splitlines()[-lines:]) or "(empty log)"


def describe_exit(code: int) -> str:
    """An exit status as a person reads it: "exited with code 3", "killed by SIGKILL"."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


# --- dying with the parent ---------------------------------------------------------------


def _prctl() -> Callable[..., int] | None:
    """libc's prctl, looked up in the parent. The child runs only the call between fork
    and exec: loading a library there could wait forever on a lock that another thread of
    the parent held at the fork."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()


def _die_with_parent() -> None:
    # Runs in the child before exec: when the parent dies, even by SIGKILL, the kernel
    # sends this child SIGTERM, so no orphan keeps holding the ports. The signal comes
    # when the thread that forked exits: spawn from a thread that outlives its children.
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _prepare_child() -> None:
    # Runs in the child before exec. A process started in the background by a script
    # (`bin/up &`), by nohup or by some supervisors has SIGINT ignored, and an ignored
    # signal stays ignored across fork and exec: its children would sit out every stop's
    # grace and be SIGKILLed. At their defaults, Python turns SIGINT into
    # KeyboardInterrupt and the roles install their own handlers, as from a terminal.
    for sig in _STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    _die_with_parent()


# --- one child -------------------------------------------------------------------------


class ChildProcess:
    """A started child: the leader of its own process group, writing to ``log``."""

    def __init__(self, name: str, popen: subprocess.Popen[bytes], log: Path) -> None:
        self.name = name
        self.popen = popen
        self.log = log

    def __repr__(self) -> str:
        return f"ChildProcess({self.name!r}, pid={self.pid}, returncode={self.poll()})"

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def poll(self) -> int | None:
        """The exit status once it has ended (negative: the signal that ended it)."""
        return self.popen.poll()

    def alive(self) -> bool:
        return self.poll() is None

    def signal(self, sig: int) -> None:
        """Signal the whole group, as the terminal would: anything the child started gets
        it too. A group already gone is not an error: it ended on its own meanwhile."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)

    def wait(self, timeout: float | None = None) -> int:
        """Its exit status; ``subprocess.TimeoutExpired`` if it is still running then."""
        return self.popen.wait(timeout=timeout)

    def kill(self, timeout: float | None = 20.0) -> int:
        """SIGKILL the group and reap the child."""
        self.signal(signal.SIGKILL)
        return self.wait(timeout)

    def text(self) -> str:
        """Everything in its log so far."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, lines: int = TAIL_LINES) -> str:
        return tail(self.log, lines)


def spawn(
    name: str,
    argv: Sequence[str],
    log: Path,
    *,
    append: bool = False,
    env: Mapping[str, str] | None = None,
) -> ChildProcess:
    """Start ``argv`` in a new session with stdout and stderr to ``log`` (private; truncated,
    or continued with ``append``) and stdin from /dev/null.

    ``env`` replaces the environment (default: this process's); either way the child runs
    with PYTHONUNBUFFERED=1, so its lines reach the log as they happen and a crash leaves
    its last words there.
    """
    environ = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    with open_private_log(log, append=append) as out:
        popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=environ,
            # Its own session and group: a Ctrl-C in the terminal reaches the parent alone,
            # which stops its children in the order it chooses.
            start_new_session=True,
            preexec_fn=_prepare_child,
        )
    return ChildProcess(name, popen, log)
