"""A real `onedoor demo` for the whole session: the gateway in front of its simulated fleet.

The fixture starts `$ONEDOOR_BIN demo --port <free port>`, reads what it prints until the
copy-paste examples are complete, and hands the tests the URL, the key and the printed text.
"""

import contextlib
import os
import queue
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass

import pytest

READY_TIMEOUT_S = 30.0
LAST_LINE = "Ctrl-C stops it all."


@dataclass(frozen=True)
class Demo:
    url: str
    key: str
    text: str


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(stream, lines: "queue.Queue[str | None]") -> None:
    """Copies every stdout line into the queue (None at EOF), so the pipe never fills up."""
    for line in iter(stream.readline, ""):
        lines.put(line)
    lines.put(None)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    """The demo most tests share, in a folder of its own: its usage file stays out of the checkout."""
    with running_demo(cwd=str(tmp_path_factory.mktemp("demo"))) as started:
        yield started


@pytest.fixture(scope="module")
def own_demo(tmp_path_factory):
    """A demo for one test module alone, for tests that break its simulated upstreams."""
    with running_demo(cwd=str(tmp_path_factory.mktemp("demo"))) as started:
        yield started


PORT_TRIES = 5


def _start(binary: str, cwd: str, port: int):
    """Starts `onedoor demo --port PORT` and reads until it is ready: (process, its stderr file,
    the lines it printed, None) when it is, or with why not in the last place."""
    # The gateway logs every request on stderr: a file, not an unread pipe that could fill up and block it.
    stderr = tempfile.TemporaryFile(mode="w+", prefix="onedoor-demo-stderr-")
    proc = subprocess.Popen(
        [binary, "demo", "--port", str(port)],
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )
    lines: "queue.Queue[str | None]" = queue.Queue()
    threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
    printed: list[str] = []
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not any(line.strip() == LAST_LINE for line in printed):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return proc, stderr, printed, f"did not print {LAST_LINE!r} within {READY_TIMEOUT_S:.0f}s"
        try:
            line = lines.get(timeout=remaining)
        except queue.Empty:
            continue
        if line is None:
            proc.wait(timeout=5)
            return proc, stderr, printed, f"exited with code {proc.returncode} before printing {LAST_LINE!r}"
        printed.append(line)
    return proc, stderr, printed, None


@contextlib.contextmanager
def running_demo(cwd: str):
    """A fresh `onedoor demo` (in `cwd`, where it keeps its usage file), stopped on exit."""
    binary = os.environ.get("ONEDOOR_BIN", "")
    if not binary or not os.path.isfile(binary) or not os.access(binary, os.X_OK):
        pytest.fail(
            f"ONEDOOR_BIN={binary!r} is not an executable onedoor binary; "
            "run `cargo build -p onedoor` first (tests/e2e/run points ONEDOOR_BIN at target/debug/onedoor)",
            pytrace=False,
        )
    # The demo runs in `cwd`: a relative path to the binary is read from here.
    binary = os.path.abspath(binary)
    # A free port can be taken between `_free_port` and the demo's bind (by one of the demo's own
    # simulated upstreams, or a client socket of an earlier test): such a start is tried again.
    for attempt in range(PORT_TRIES):
        port = _free_port()
        proc, stderr, printed, why = _start(binary, cwd, port)
        if why is None:
            break
        stderr.seek(0)
        if "Address already in use" not in stderr.read() or attempt == PORT_TRIES - 1:
            break
        _stop(proc)
        stderr.close()
    def fail(why: str) -> None:
        _stop(proc)
        stderr.seek(0)
        pytest.fail(
            f"`onedoor demo --port {port}` {why}\n--- stdout ---\n{''.join(printed)}--- stderr ---\n{stderr.read()}",
            pytrace=False,
        )

    if why is not None:
        fail(why)
    text = "".join(printed)
    url = re.search(r"^export ONEDOOR_URL=(\S+)\s*$", text, re.M)
    key = re.search(r"^export ONEDOOR_KEY=(\S+)\s*$", text, re.M)
    if not url or not key:
        fail("printed no `export ONEDOOR_URL=...` / `export ONEDOOR_KEY=...` lines")
    try:
        yield Demo(url=url.group(1), key=key.group(1), text=text)
    finally:
        _stop(proc)
        stderr.close()
