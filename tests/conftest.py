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


@pytest.fixture
def sigint_repeatedly():
    """Context manager factory: inside the block, SIGINT arrives every 20 ms after `delay` seconds,
    like a user holding Ctrl-C; outside it, stray signals are ignored. No race with fast machines
    (one fixed-time signal can land after the work is done) nor with slow ones. The block gets an
    object whose `first_signal_at` is the time.monotonic() of the first signal sent (None if none)."""
    import contextlib
    import signal
    import threading
    import time
    from types import SimpleNamespace

    @contextlib.contextmanager
    def arm(delay: float = 0.02):
        armed = threading.Event()
        stop = threading.Event()
        signals = SimpleNamespace(first_signal_at=None)

        def handler(signum, frame):
            # One KeyboardInterrupt per block: a handler may run at any bytecode, even inside the
            # cleanup below, so it disarms itself and stops the sender before raising.
            if armed.is_set():
                armed.clear()
                stop.set()
                raise KeyboardInterrupt

        def sender():
            if stop.wait(delay):
                return
            while not stop.is_set():
                if signals.first_signal_at is None:
                    signals.first_signal_at = time.monotonic()
                os.kill(os.getpid(), signal.SIGINT)
                stop.wait(0.02)

        previous = signal.signal(signal.SIGINT, handler)
        armed.set()
        thread = threading.Thread(target=sender, daemon=True)
        thread.start()
        try:
            yield signals
        finally:
            armed.clear()
            stop.set()
            thread.join()
            signal.signal(signal.SIGINT, previous)

    return arm
