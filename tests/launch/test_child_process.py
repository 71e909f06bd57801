"""spawn and ChildProcess with real (tiny Python) children: the log file, the process group,
dying with the parent, the tail of the log; the private log folder and files."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from zmqllm.launch.child_process import (
    describe_exit,
    open_private_log,
    private_log_dir,
    spawn,
    tail,
)

LINUX = sys.platform.startswith("linux")


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def wait_for(predicate: Callable[[], object], timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def gone(pid: int) -> bool:
    """True once ``pid`` is no longer running (a zombie counts as gone: it has ended)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return "\nState:\tZ" in status


def test_output_goes_to_a_private_log_and_stdin_is_empty(tmp_path: Path) -> None:
    code = (
        "import os, sys; print('out', os.environ['PYTHONUNBUFFERED']); "
        "print('err', file=sys.stderr); print('stdin', repr(sys.stdin.read()))"
    )
    child = spawn("probe", py(code), tmp_path / "probe.log", env={"PATH": os.defpath})
    assert child.wait(timeout=30) == 0
    assert child.returncode == 0 and not child.alive()
    lines = child.text().splitlines()
    assert sorted(lines) == ["err", "out 1", "stdin ''"]
    assert stat.S_IMODE((tmp_path / "probe.log").stat().st_mode) == 0o600


def test_a_fresh_log_replaces_the_old_one_and_append_continues_it(tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    log.write_text("stale\n")
    spawn("w", py("print('first run')"), log).wait(timeout=30)
    assert log.read_text() == "first run\n"
    spawn("w", py("print('second run')"), log, append=True).wait(timeout=30)
    assert log.read_text() == "first run\nsecond run\n"


def test_the_child_leads_its_own_group_and_a_signal_reaches_all_of_it(tmp_path: Path) -> None:
    # The child starts a grandchild (which stays in its group) and prints both pids.
    code = (
        "import subprocess, sys, time; "
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        "print(g.pid, flush=True); time.sleep(600)"
    )
    child = spawn("parent", py(code), tmp_path / "parent.log")
    try:
        wait_for(lambda: child.text().strip(), what="the grandchild's pid")
        grandchild = int(child.text().split()[0])
        assert os.getpgid(child.pid) == child.pid != os.getpgid(0)
        assert os.getpgid(grandchild) == child.pid
        child.signal(signal.SIGTERM)
        assert child.wait(timeout=30) == -signal.SIGTERM
        wait_for(lambda: gone(grandchild), what="the grandchild to end")
        child.signal(signal.SIGTERM)  # the group is gone: not an error
    finally:
        child.kill()


def test_a_child_starts_with_the_stop_signals_at_their_defaults(tmp_path: Path) -> None:
    """Whatever this process has: a background job of a script starts with SIGINT ignored,
    and an ignored signal would stay ignored in every child it starts."""
    code = (
        "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler,"
        " signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)"
    )
    stops = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in stops}
    try:
        child = spawn("probe", py(code), tmp_path / "probe.log")
    finally:  # the test runner's own handlers, whatever they were
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert child.wait(timeout=30) == 0
    assert child.text().split() == ["True", "True"]


def test_kill_ends_the_child_and_reaps_it(tmp_path: Path) -> None:
    child = spawn("sleeper", py("import time; time.sleep(600)"), tmp_path / "s.log")
    assert child.alive() and child.poll() is None
    assert child.kill() == -signal.SIGKILL
    assert not child.alive()
    assert "sleeper" in repr(child) and str(child.pid) in repr(child)


def test_wait_with_a_timeout_raises_while_it_runs(tmp_path: Path) -> None:
    child = spawn("sleeper", py("import time; time.sleep(600)"), tmp_path / "s.log")
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=0.1)
    finally:
        child.kill()


@pytest.mark.skipif(not LINUX, reason="PR_SET_PDEATHSIG is Linux only")
def test_a_child_dies_with_its_parent_even_a_sigkilled_one(tmp_path: Path) -> None:
    # The parent is itself a process that spawns a child, prints the child's pid, and
    # waits: SIGKILL gives it no chance to stop its child, the kernel must.
    code = (
        "import sys, time; from pathlib import Path; "
        "from zmqllm.launch.child_process import spawn; "
        "c = spawn('orphan', [sys.executable, '-c', 'import time; time.sleep(600)'], "
        f"Path({str(tmp_path / 'orphan.log')!r})); "
        "print(c.pid, flush=True); time.sleep(600)"
    )
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    parent = spawn("parent", py(code), tmp_path / "parent.log", env=env)
    orphan = 0
    try:
        wait_for(lambda: parent.text().strip(), what="the child's pid")
        orphan = int(parent.text().split()[0])
        assert not gone(orphan)
        parent.kill()
        wait_for(lambda: gone(orphan), what="the orphan to end")
    finally:
        parent.kill()
        if orphan and not gone(orphan):
            os.killpg(orphan, signal.SIGKILL)


def test_tail_and_describe_exit(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    assert tail(log) == "(no log)"
    log.write_text("")
    assert tail(log) == "(empty log)"
    log.write_text("".join(f"line {i}\n" for i in range(30)))
    assert tail(log, 3) == "line 27\nline 28\nline 29"
    assert tail(log).splitlines()[0] == "line 10"  # 20 lines unless told
    assert describe_exit(0) == "exited with code 0"
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(-200) == "killed by signal 200"


def test_a_tail_printed_to_the_terminal_carries_no_escapes(tmp_path: Path) -> None:
    """`zmqllm up` prints a failing child's last lines: they may quote a peer or a client."""
    log = tmp_path / "x.log"
    log.write_text('boom: bad host "evil\x1b[2J\x9b2J"\r\nlast\n')
    assert tail(log) == 'boom: bad host "evil\\x1b[2J\\x9b2J"\nlast'


def test_log_files_are_private_whatever_the_umask(tmp_path: Path) -> None:
    old_umask = os.umask(0)
    try:
        folder = tmp_path / "new" / "logs"
        private_log_dir(folder)
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        wide = folder / "gateway.log"
        wide.write_text("old\n")
        wide.chmod(0o644)
        with open_private_log(wide, append=True) as out:
            out.write(b"new\n")
        assert wide.read_text() == "old\nnew\n"
        assert stat.S_IMODE(wide.stat().st_mode) == 0o600
    finally:
        os.umask(old_umask)


def test_a_shared_sticky_folder_is_left_as_it_is(tmp_path: Path) -> None:
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    private_log_dir(sticky)
    assert stat.S_IMODE(sticky.stat().st_mode) == 0o1777
    with open_private_log(sticky / "gateway.log") as out:
        out.write(b"x")
    assert stat.S_IMODE((sticky / "gateway.log").stat().st_mode) == 0o600
