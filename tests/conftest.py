"""Hypothesis profiles: "ci" (default, bounded time) and "fuzz" (`make fuzz`, >= 10,000 examples)."""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=200, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "fuzz", max_examples=10_000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# Test data lives beside the checkout (../shared), as on CI; $TRAINFAST_SHARED overrides.
SHARED_DIR = Path(os.environ.get("TRAINFAST_SHARED", Path(__file__).resolve().parents[1].parent / "shared"))


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """../shared (fixtures/, corpora/); a missing directory fails loudly rather than skipping."""
    if not SHARED_DIR.is_dir():
        pytest.fail(f"test data directory {SHARED_DIR} is missing (set TRAINFAST_SHARED)")
    return SHARED_DIR


def pytest_report_header(config):
    import trainfast
    from trainfast import _core

    return f"trainfast {trainfast.__version__} from {Path(_core.__file__).resolve()}"


# The Ctrl-C sender runs in its own process: a thread of ours would need the GIL to send, so a
# call that held the GIL would delay its own signal and look as if it stopped at once.
_SIGINT_SENDER = """
import os, signal, sys, time
pid, delay = int(sys.argv[1]), float(sys.argv[2])
print("ready", flush=True)
time.sleep(delay)
print(time.monotonic(), flush=True)
while True:
    os.kill(pid, signal.SIGINT)
    time.sleep(0.02)
"""


class OneKeyboardInterrupt:
    """A signal handler that raises KeyboardInterrupt once per arming (set `armed`): a handler may
    run at any bytecode, even inside the caller's cleanup, so it disarms itself before raising."""

    def __init__(self) -> None:
        self.armed = False

    def __call__(self, signum, frame) -> None:
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt


@pytest.fixture
def one_keyboard_interrupt():
    return OneKeyboardInterrupt()


@pytest.fixture
def sigint_repeatedly():
    """Context manager factory: inside the block, SIGINT arrives every 20 ms from `delay` seconds
    after the block is entered, like a user holding Ctrl-C; outside it, stray signals are ignored.
    No race with fast machines (one fixed-time signal can land after the work is done) nor with
    slow ones. The sending process has started before the block is entered: started alongside the
    work, it competed with the work's threads for the cores (16 merging threads: its first signal
    came 0.03-0.10 s after the start, not 0.02).
    The block gets an object whose `first_signal_at` is the time.monotonic() of the first signal
    sent (None if none), set when the block exits."""
    import contextlib
    import signal
    import subprocess
    import sys
    import time
    from types import SimpleNamespace

    @contextlib.contextmanager
    def arm(delay: float = 0.02):
        signals = SimpleNamespace(first_signal_at=None)
        handler = OneKeyboardInterrupt()  # one per block
        handler.armed = True
        previous = signal.signal(signal.SIGINT, handler)
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # no sanitizer in the sender
        sender = subprocess.Popen(
            [sys.executable, "-c", _SIGINT_SENDER, str(os.getpid()), repr(delay)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        try:
            if sender.stdout.readline() != "ready\n":
                raise RuntimeError("the SIGINT sender did not start")
            yield signals
        finally:
            handler.armed = False
            sender.kill()
            first_line = sender.communicate()[0].split("\n")[0]
            signals.first_signal_at = float(first_line) if first_line else None
            signal.signal(signal.SIGINT, previous)

    return arm


# Skips that are the machine's to decide. Under CI ($CI set, as .ci/run sets it) any other skip is a
# test dependency gone missing (megatron-core, tiktoken, ...), which must fail rather than pass quietly.
_MACHINE_SKIPS = ("no GPU here", "GiB or more of memory", "this tiktoken matched the longer special token")
_unexpected_skips: list[str] = []


def _note_skip(report) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)
        if not any(allowed in reason for allowed in _MACHINE_SKIPS):
            _unexpected_skips.append(f"{report.nodeid}: {reason}")


def pytest_collectreport(report):
    _note_skip(report)


def pytest_runtest_logreport(report):
    _note_skip(report)


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("CI") and _unexpected_skips and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if os.environ.get("CI") and _unexpected_skips:
        terminalreporter.write_line("skipped under CI, where every test dependency must be present:", red=True)
        for line in _unexpected_skips:
            terminalreporter.write_line(f"  {line}", red=True)


@pytest.fixture
def walk_slack():
    """A setter of the bytes special-token walks may compare before the reverse automaton takes
    over (process-wide), restored after the test."""
    from trainfast import _core

    before = _core._special_token_walk_slack()
    yield _core._set_special_token_walk_slack
    _core._set_special_token_walk_slack(before)


@pytest.fixture(params=["walks", "automaton"])
def special_token_search(request, walk_slack):
    """Runs a test twice: special tokens found by trie walks (the default on short texts), and by
    the reverse automaton that takes over from walks comparing too much (slack 0 sends small texts
    with tokens over 64 bytes there)."""
    if request.param == "automaton":
        walk_slack(0)
    return request.param
