"""`ExitWatch` on a real child process: quiet while it runs, told once it is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

from service.engine.exit_watch import ExitWatch, exiting


def sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def test_a_running_process_is_not_exiting_and_a_killed_unreaped_one_is() -> None:
    child = sleeper()
    try:
        assert not exiting(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # dead, still a zombie
        assert exiting(child.pid)
    finally:
        child.kill()
        child.wait()
    assert exiting(child.pid), "a reaped process is gone, which counts as exiting"


def test_the_watch_calls_back_once_after_a_sigkill_and_not_before() -> None:
    child = sleeper()
    told: list[int] = []
    called = threading.Event()

    def on_exit() -> None:
        told.append(child.pid)
        called.set()

    watch = ExitWatch(child.pid, on_exit)
    try:
        assert not called.wait(0.2), "told while the process runs"
        child.kill()
        assert called.wait(30), "never told of the kill"
    finally:
        watch.stop()
        child.kill()
        child.wait()
    assert told == [child.pid]
