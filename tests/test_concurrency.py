"""Many Python threads at once, fork() after a call, thread-count determinism, for every kernel.

Each kernel registers a zero-argument callable returning a comparable result in CALLS.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from trainfast import bpe, buckets, checkpoint, eplb, pipeline


def _checkpoint_call():
    rng = np.random.default_rng(7)
    is_bytes = rng.random(50_000) < 0.05
    sizes = rng.integers(0, 1 << 30, 50_000)
    plan = checkpoint.assign_bins(is_bytes, sizes, 8)
    return tuple(t.tolist() for t in plan)


_WRITE_ITEMS = None


def _checkpoint_write_items_call(num_threads=None):
    # 40k WriteItems: the items are read on several threads (past 32k), each call on its own threads.
    global _WRITE_ITEMS
    if _WRITE_ITEMS is None:
        from trainfast._examples import gpt_write_items

        _WRITE_ITEMS = gpt_write_items(num_layers=48) * 28
    binned = checkpoint.split_by_size_and_type(8, _WRITE_ITEMS, num_threads=num_threads)
    return [[id(item) for item in group] for group in binned]


def _buckets_call(num_threads=None):
    rng = np.random.default_rng(3)
    layout = buckets.plan_layout(rng.integers(1, 10**6, 3000), bucket_size=4_000_000, data_parallel_world_size=64)
    return tuple(t.tolist() for t in buckets.shard_ranges(layout, 64, num_threads=num_threads))


def _eplb_call(num_threads=None, tie_break="torch"):
    import torch

    generator = torch.Generator().manual_seed(5)
    weight = torch.randint(0, 50, (58, 256), generator=generator)
    out = eplb.rebalance_experts(weight, 288, 8, 4, 32, tie_break=tie_break, num_threads=num_threads)
    return tuple(t.tolist() for t in out)


def _pipeline_call():
    costs = np.random.default_rng(11).random(1000)
    plan, layout = pipeline.balanced_layout(costs, 16, 4)
    return layout, tuple((key, tuple(value)) for key, value in plan.items())


_TEXT = "The quick brown fox's 123 jumps\n\nover the lazy dog. Überall 日本語 テキスト!\r\n" * 2000


def _bpe_count_call(num_threads=None):
    return sorted(bpe.count_pretokens(iter([_TEXT] * 4), num_threads=num_threads).items())


def _bpe_train_call(num_threads=None):
    return bpe.train_bpe(iter([_TEXT]), 400, ["<|endoftext|>"], num_threads=num_threads, show_progress=False)


def _bpe_encode_call(num_threads=None):
    vocab, merges = _bpe_train_call()
    tokenizer = bpe.Tokenizer(vocab, merges, ["<|endoftext|>"])
    return tokenizer.encode(_TEXT), tokenizer.encode_batch(_TEXT.splitlines()[:500], num_threads=num_threads)


CALLS = {
    "checkpoint.assign_bins": _checkpoint_call,
    "checkpoint.split_by_size_and_type": _checkpoint_write_items_call,
    "pipeline.balanced_layout": _pipeline_call,
    "bpe.count_pretokens": _bpe_count_call,
    "bpe.train_bpe": _bpe_train_call,
    "bpe.Tokenizer.encode": _bpe_encode_call,
    "buckets.shard_ranges": _buckets_call,
    "eplb.rebalance_experts": _eplb_call,
}
# Kernels with a num_threads argument: same answer for any thread count.
THREADED_CALLS = {
    "checkpoint.split_by_size_and_type": _checkpoint_write_items_call,
    "bpe.count_pretokens": _bpe_count_call,
    "bpe.train_bpe": _bpe_train_call,
    "bpe.Tokenizer.encode_batch": _bpe_encode_call,
    "buckets.shard_ranges": _buckets_call,
    "eplb.rebalance_experts": _eplb_call,
    "eplb.rebalance_experts(stable)": lambda num_threads=None: _eplb_call(num_threads, "stable"),
}


@pytest.mark.parametrize("name", sorted(THREADED_CALLS))
def test_thread_count_does_not_change_results(name):
    call = THREADED_CALLS[name]
    expected = call(num_threads=1)
    for num_threads in (2, 7, 1):
        assert call(num_threads=num_threads) == expected


@pytest.mark.parametrize("name", sorted(CALLS))
def test_threads_get_the_sequential_answer(name):
    call = CALLS[name]
    expected = call()
    results: list = [None] * 8
    errors: list = []

    def worker(slot: int) -> None:
        try:
            results[slot] = call()
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(results))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "deadlock: a thread did not finish"
    assert errors == []
    assert all(result == expected for result in results)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
@pytest.mark.parametrize("name", sorted(CALLS))
def test_calls_work_after_fork(name):
    call = CALLS[name]
    expected = call()
    pid = os.fork()
    if pid == 0:  # child: no worker thread may have survived the fork
        try:
            os._exit(0 if call() == expected else 1)
        except BaseException:  # noqa: BLE001
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def _race_with_writer(call, write, num_calls: int) -> None:
    """Runs call() num_calls times while another thread keeps writing to its input arrays in place;
    each call must return or raise ValueError, never write out of bounds (this crashed before)."""
    stop = threading.Event()

    def writer():
        while not stop.is_set():
            write()

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for _ in range(num_calls):
            try:
                call()
            except ValueError:
                pass
    finally:
        stop.set()
        thread.join()


def test_assign_bins_while_another_thread_writes_the_arrays():
    num_items = 1_000_000
    is_bytes = np.zeros(num_items, dtype=np.uint8)
    sizes = np.arange(num_items, dtype=np.int64) % 5000

    def flip():
        is_bytes[:] = 1
        is_bytes[:] = 0

    _race_with_writer(lambda: checkpoint.assign_bins(is_bytes, sizes, 8), flip, 60)


def test_shard_ranges_while_another_thread_writes_the_layout():
    layout = buckets.plan_layout(np.full(200_000, 64, dtype=np.int64), data_parallel_world_size=8)
    full_end, start = layout.param_end.clone(), layout.param_start.clone()

    def flip():
        layout.param_end.copy_(start)  # every param empty, then whole again
        layout.param_end.copy_(full_end)

    _race_with_writer(lambda: buckets.shard_ranges(layout, 8, num_threads=1), flip, 100)


def test_progress_bars_on_a_terminal_leave_no_thread(tmp_path):
    """tqdm's monitor thread outlives its bars; the bars shown on a terminal must not start it."""
    import pty
    import sys

    code = (
        "import os, sys, threading\n"
        "from trainfast import bpe\n"
        "before = (len(threading.enumerate()), len(os.listdir('/proc/self/task')))\n"
        "bpe.train_bpe(iter(['hello world ' * 1000]), 300, show_progress=True)\n"
        "bpe.count_pretokens(iter(['hello world ' * 1000]), show_progress=True)\n"
        "after = (len(threading.enumerate()), len(os.listdir('/proc/self/task')))\n"
        "print('\\nTHREADS', before == after, after)\n"
    )
    pid, fd = pty.fork()
    if pid == 0:  # the child: stderr is the pty, so the bars are tqdm's
        os.execv(sys.executable, [sys.executable, "-c", code])
    out = b""
    try:
        while chunk := os.read(fd, 65536):
            out += chunk
    except OSError:  # the pty closes when the child exits
        pass
    os.waitpid(pid, 0)
    lines = [line for line in out.decode(errors="replace").splitlines() if line.startswith("THREADS")]
    assert lines and lines[0].startswith("THREADS True"), out.decode(errors="replace")[-2000:]


def test_train_bpe_logs_nothing_without_progress(caplog):
    with caplog.at_level("DEBUG", logger="trainfast"):
        bpe.train_bpe(iter(["hello world " * 100]), 300, show_progress=False)
        bpe.train_from_counts({b"ab": 3, b"abc": 2}, 260, show_progress=False)
    assert caplog.records == []


# --- heavy calls release the GIL ------------------------------------------------------------------------------


def _long_bpe_merges():
    import random

    rng = random.Random(0)
    blob = rng.randbytes(200_000 * 16).translate(bytes(97 + i % 26 for i in range(256)))
    word_counts = {blob[i:i + 4 + i % 17]: 1 + i % 997 for i in range(0, len(blob), 16)}
    return lambda: bpe.train_from_counts(word_counts, 200_256, show_progress=False)


def _long_balanced_layout():
    costs = np.random.default_rng(0).uniform(0.5, 1.5, 300_000)
    return lambda: pipeline.balanced_layout(costs, 16, 4)


def _long_assign_bins():
    sizes = np.random.default_rng(0).integers(0, 1 << 20, 3_000_000)
    return lambda: checkpoint.assign_bins(np.zeros(len(sizes), dtype=bool), sizes, 64)


def _long_rebalance():
    import torch

    weight = torch.from_numpy(np.random.default_rng(0).lognormal(0, 1, (20_000, 256)).astype(np.float32))
    return lambda: eplb.rebalance_experts(weight, 320, 8, 4, 64, num_threads=1)


# Calls of 0.4 s or more each here (a shorter one makes an ordinary scheduling pause look
# like a held GIL); each builds its input first, outside the timed window.
_LONG_CALLS = {"pipeline.balanced_layout": _long_balanced_layout, "checkpoint.assign_bins": _long_assign_bins,
               "eplb.rebalance_experts": _long_rebalance, "bpe.train_from_counts": _long_bpe_merges}


@pytest.mark.parametrize("name", _LONG_CALLS)
def test_heavy_calls_let_other_threads_run(name):
    # A Python thread ticks while the call runs: with the GIL held through the native work it
    # could not tick at all until the call returned.
    import time

    call = _LONG_CALLS[name]()
    silences, stop = [], threading.Event()  # (from, to) of every pause of the ticker over 1 ms

    def ticker():
        previous = time.perf_counter()
        while True:
            now = time.perf_counter()
            if now - previous > 1e-3:
                silences.append((previous, now))
            previous = now
            if stop.is_set():  # checked after recording: the pause that ends here counts
                return

    thread = threading.Thread(target=ticker)
    thread.start()
    try:
        start = time.perf_counter()
        call()
        end = time.perf_counter()
    finally:
        stop.set()
        thread.join()
    longest_silence = max((min(b, end) - max(a, start) for a, b in silences if b > start and a < end), default=0.0)
    assert longest_silence < 0.5 * (end - start), (name, end - start, longest_silence)
