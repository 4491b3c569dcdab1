"""Bad labels the GPU finds after its op returned: kept, then raised at the next op.

In the default commit mode the Metal kernels run after the op has returned, so a completion
handler on the command buffer hands the kernel's error record to csrc/pending_errors.cc, and
the next CustomLoss / CustomLossGrad execution (any device) or tf_metal_ops.debug.check_errors()
raises it. Here the handler's platform-neutral part is called the way the handler calls it:
with records written by hand, and with the record the emulated kernel wrote for a bad batch
(tests/msl_host/); the op that then raises is the CPU one, which shares the check.
"""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import tensorflow as tf

import tf_metal_ops
from tf_metal_ops import _native, debug

pytestmark = [pytest.mark.tf_abi, pytest.mark.native]

sys.path.insert(0, str(Path(__file__).resolve().parent / "msl_host"))
import msl_build as mb  # noqa: E402
import raw_ops  # noqa: E402
from msl_build import msl_cache_dir  # noqa: E402,F401  (pytest fixture)

NO_ROW = 0xFFFFFFFF


def make_record(claimed_row: Optional[int] = None, label: int = 0, *, count: int = 1,
                lowest: Optional[int] = None) -> bytes:
    """A CustomLossErrorRecord (kernels/custom_loss_params.h) as the kernels leave it."""
    words = np.zeros(8, np.uint32)
    words[1] = NO_ROW
    if claimed_row is not None:
        words[0] = count
        words[1] = claimed_row if lowest is None else lowest
        words[2] = 1
        words[3] = claimed_row
        words[4:6] = np.array([label], np.int64).view(np.uint32)
    return words.tobytes()


def report(record: bytes, node: str = "model/loss/CustomLoss", direction: str = "forward",
           row_dims=(8,), num_classes: int = 5, ignore_class: Optional[int] = None) -> bool:
    return _native.runtime().report_completed_error_record(
        record, node, direction, list(row_dims), num_classes, ignore_class is not None,
        0 if ignore_class is None else ignore_class)


def run_cpu_op(num_rows: int = 4, num_classes: int = 3) -> np.ndarray:
    labels = np.zeros([num_rows], np.int32)
    return tf_metal_ops.custom_loss(labels, tf.zeros([num_rows, num_classes])).numpy()


@pytest.fixture(autouse=True)
def no_error_left_behind():
    # A pending error would fail the next test's first op: every test starts and ends clean.
    _native.runtime().take_pending_error()
    yield
    leftover = _native.runtime().take_pending_error()
    assert leftover is None, f"the test left a pending error: {leftover}"


def test_no_record_no_error():
    assert report(make_record()) is False
    assert not debug.has_pending_error()
    debug.check_errors()  # nothing to raise
    np.testing.assert_allclose(run_cpu_op(), np.log(3.0), rtol=1e-6)


def test_next_op_raises_the_pending_error_with_op_row_and_label():
    assert report(make_record(6, 1234), node="train/loss/CustomLoss") is True
    assert debug.has_pending_error()
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        run_cpu_op()
    message = str(info.value)
    assert "TfMetalOps>CustomLoss (node 'train/loss/CustomLoss')" in message, message
    assert "labels[6] = 1234 is not a class id in [0, 5)" in message, message
    assert "found by the GPU after the op had returned" in message, message
    # Raised once: the op after it runs normally.
    assert not debug.has_pending_error()
    np.testing.assert_allclose(run_cpu_op(), np.log(3.0), rtol=1e-6)


def test_gradient_op_raises_it_too_and_names_the_gradient_node():
    report(make_record(1, -7), node="grad/CustomLossGrad", direction="gradient", row_dims=(2, 3),
           num_classes=10, ignore_class=-100)
    labels = tf.constant([0, 1], tf.int32)
    z = tf.zeros([2, 3])
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        raw_ops.gradient(z, labels, raw_ops.NO_WEIGHTS, tf.ones([2])).numpy()
    message = str(info.value)
    # row 1 of row_dims [2, 3] is labels[0, 1]; ignore_class is named as the CPU names it.
    assert "TfMetalOps>CustomLossGrad (node 'grad/CustomLossGrad')" in message, message
    assert "labels[0, 1] = -7 is not a class id in [0, 10) nor ignore_class (-100)" in message


def test_check_errors_raises_and_clears():
    report(make_record(3, 2**40))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"labels\[3\] = 1099511627776"):
        debug.check_errors()
    assert not debug.has_pending_error()
    debug.check_errors()
    run_cpu_op()


def test_the_first_of_two_errors_wins_and_the_second_is_counted():
    assert report(make_record(2, 99), node="first") is True
    assert report(make_record(5, -1), node="second") is True  # held an error, but dropped
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        debug.check_errors()
    message = str(info.value)
    assert "node 'first'" in message and "labels[2] = 99" in message, message
    assert "second" not in message and "labels[5]" not in message, message
    assert "1 later GPU error was dropped" in message, message
    # After it was taken, the next error is kept again.
    report(make_record(5, -1), node="second")
    with pytest.raises(tf.errors.InvalidArgumentError, match="node 'second'"):
        debug.check_errors()


def test_several_bad_rows_name_the_lowest_one_too():
    # The claimed detail belongs to row 6, but row 2 was bad too (the atomic minimum).
    report(make_record(6, 40, count=3, lowest=2))
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        debug.check_errors()
    message = str(info.value)
    assert "labels[6] = 40 is not a class id" in message, message
    assert "3 rows have labels outside the class range, the first of them is labels[2]" in message


def test_a_record_of_the_wrong_size_is_an_internal_error():
    assert report(make_record(1, 9)[:16]) is True
    with pytest.raises(tf.errors.InternalError, match="has 16 bytes, expected 32"):
        debug.check_errors()


def test_bad_arguments_of_the_hook_are_refused():
    with pytest.raises(ValueError, match="'sideways'"):
        report(make_record(1, 9), direction="sideways")
    with pytest.raises(ValueError, match="num_classes must be >= 1, got 0"):
        report(make_record(1, 9), num_classes=0)


def test_concurrent_reports_and_takes_lose_nothing():
    # Handlers on Metal's threads, ops and check_errors on others: every reported error is
    # either raised or counted as dropped in the message of the one raised before it.
    reporters, per_thread = 4, 300
    raised = []
    done = threading.Event()

    def reporter(index: int):
        for i in range(per_thread):
            report(make_record(i % 8, 100 + index), node=f"reporter{index}")

    def taker():
        while not done.is_set():
            taken = _native.runtime().take_pending_error()
            if taken is not None:
                raised.append(taken[1])

    threads = [threading.Thread(target=reporter, args=(k,)) for k in range(reporters)]
    takers = [threading.Thread(target=taker) for _ in range(2)]
    for t in takers + threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    for t in takers:
        t.join()
    last = _native.runtime().take_pending_error()
    if last is not None:
        raised.append(last[1])

    accounted = 0
    for message in raised:
        assert re.search(r"node 'reporter\d'\): labels\[\d\] = 10\d is not a class id", message)
        dropped = re.search(r"; (\d+) later GPU errors? w[a-z]+ dropped", message)
        accounted += 1 + (int(dropped.group(1)) if dropped else 0)
    assert raised and accounted == reporters * per_thread
    assert not debug.has_pending_error()


# ---- The record an emulated kernel wrote -----------------------------------------------------

@pytest.fixture(scope="module")
def emu(msl_cache_dir) -> mb.Emulator:
    return mb.Emulator(mb.build_emulator_library(msl_cache_dir))


@pytest.mark.parametrize("direction", ["forward", "gradient"])
@pytest.mark.parametrize("label_kind", ["int32", "int64"])
def test_emulated_kernel_record_is_raised_by_the_next_op_as_the_cpu_raises_it(
        emu, direction, label_kind):
    rng = np.random.default_rng(16)
    n, c = 19, 40
    logits = rng.normal(0.0, 1.0, (n, c)).astype(np.float32)
    labels = rng.integers(0, c, n).astype(np.int32 if label_kind == "int32" else np.int64)
    labels[11] = c + 3  # one bad row: the message is the CPU's, word for word
    extra = {"upstream": np.ones(n, np.float32)} if direction == "gradient" else {}
    run = emu.run(direction=direction, logits=mb.storage(logits, "float32"), labels=labels,
                  label_kind=label_kind, **extra)
    assert run.ok, run.error
    assert run.claimed == (11, c + 3)

    node = f"emulated/{direction}"
    assert report(run.error_record.tobytes(), node=node, direction=direction, row_dims=(n,),
                  num_classes=c) is True
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        run_cpu_op()  # any op of ours, on any device, reports it
    deferred = str(info.value)

    # What the CPU kernel raises for the same batch, at the op.
    with pytest.raises(tf.errors.InvalidArgumentError) as cpu_info:
        tf_metal_ops.custom_loss(labels, logits).numpy()
    cpu_detail = re.search(r"labels\[\d+\] = -?\d+ is not a class id in \[0, \d+\)",
                           str(cpu_info.value))
    assert cpu_detail, str(cpu_info.value)
    op = "TfMetalOps>CustomLoss" if direction == "forward" else "TfMetalOps>CustomLossGrad"
    assert f"{op} (node '{node}'): {cpu_detail.group(0)}" in deferred, (deferred, cpu_detail)


def test_emulated_clean_batch_leaves_nothing_pending(emu):
    rng = np.random.default_rng(7)
    logits = rng.normal(0.0, 1.0, (9, 12)).astype(np.float32)
    labels = rng.integers(0, 12, 9).astype(np.int32)
    labels[4] = -1  # ignore_class is not an error
    run = emu.run(direction="forward", logits=mb.storage(logits, "float32"), labels=labels,
                  ignore_class=-1)
    assert run.ok and run.claimed is None
    assert report(run.error_record.tobytes(), row_dims=(9,), num_classes=12,
                  ignore_class=-1) is False
    assert not debug.has_pending_error()
    run_cpu_op()


# ---- The slab of error records (csrc/metal/error_record_slots.h) --------------------------------

class HostSlab:
    """The slab hooks of the native module (one slab in host memory, csrc/python_module.cc)."""

    def __init__(self, capacity: int = 256):
        self._rt = _native.runtime()
        self._rt.host_slab_reset(capacity)
        self.capacity = self._rt.host_slab_capacity()

    def __getattr__(self, name):
        return getattr(self._rt, f"host_slab_{name}")


def test_slab_slots_are_initialized_reused_and_never_shared():
    slab = HostSlab(3)
    assert slab.capacity == 3 and slab.in_use() == 0
    slots = [slab.acquire() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2] and slab.in_use() == 3
    assert slab.acquire() == -1  # full: the Metal path then allocates a buffer of its own
    for slot in slots:
        assert slab.read(slot) == make_record()  # initialized: no error, no row
    slab.write(slots[1], make_record(4, 77))  # what the kernel would write
    # Release copies the record out before the slot is free again.
    assert slab.release(slots[1]) == make_record(4, 77)
    assert slab.in_use() == 2
    again = slab.acquire()
    assert again == slots[1] and slab.read(again) == make_record()  # re-initialized
    # A slot released twice, or never taken, is left alone (so no slot is handed out twice).
    assert slab.release(slots[0]) == make_record()
    assert slab.release(slots[0]) == make_record() and slab.in_use() == 2
    assert slab.acquire() == slots[0] and slab.acquire() == -1
    assert slab.release(7) == make_record() and slab.in_use() == 3
    with pytest.raises(ValueError, match=r"slot must be in \[0, 3\), got 3"):
        slab.read(3)


def test_slab_released_record_feeds_the_pending_error():
    slab = HostSlab()
    assert slab.capacity == 256
    slot = slab.acquire()
    slab.write(slot, make_record(2, 9))
    assert report(slab.release(slot), node="slab/CustomLoss") is True
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"node 'slab/CustomLoss'.*labels\[2\] = 9"):
        debug.check_errors()


def test_slab_concurrent_acquire_and_release():
    slab = HostSlab(8)
    failures = []

    def worker():
        for _ in range(500):
            slot = slab.acquire()
            if slot < 0:
                continue
            if slab.read(slot) != make_record():
                failures.append(f"slot {slot} handed out without being initialized")
            slab.write(slot, make_record(slot, slot))
            if slab.release(slot) != make_record(slot, slot):
                failures.append(f"slot {slot} written by two holders")

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[:3]
    assert slab.in_use() == 0


# ---- check_errors waits for launches that have not reported yet (pending_errors.h) -------------
#
# The host stand-in for a tensorflow-metal stream (HostStream, csrc/python_module.cc): a launch
# encoded on it sits in the stream's current command buffer, outstanding, until a commit hands the
# buffer to the "GPU" (a thread), which completes it after gpu_seconds and runs its completion
# handlers handler_seconds later. check_errors must commit that buffer through the registered
# flush and then wait for the handlers, which a bare wait for the buffer's completion would miss.

@pytest.fixture
def host_stream():
    rt = _native.runtime()

    def install(gpu_seconds: float = 0.05, handler_seconds: float = 0.1, flush: bool = True):
        rt.host_stream_install(gpu_seconds, handler_seconds, flush)
        return rt

    yield install
    # Whatever a test left uncommitted completes before the next one starts.
    rt.host_stream_commit()
    assert rt.wait_for_outstanding_launches(10.0) is None
    rt.host_stream_uninstall()
    assert rt.outstanding_launches() == 0


def encode(rt, record: bytes, node: str = "gpu/loss/CustomLoss", direction: str = "forward",
           row_dims=(8,), num_classes: int = 5, ignore_class: Optional[int] = None) -> None:
    rt.host_stream_encode(record, node, direction, list(row_dims), num_classes,
                          ignore_class is not None, 0 if ignore_class is None else ignore_class)


def test_check_errors_commits_and_waits_for_a_launch_not_yet_committed(host_stream):
    rt = host_stream()
    encode(rt, make_record(3, 17), node="uncommitted/CustomLoss")
    assert rt.outstanding_launches() == 1
    assert not debug.has_pending_error()  # the GPU has not even been given the kernel
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        debug.check_errors()
    message = str(info.value)
    assert "TfMetalOps>CustomLoss (node 'uncommitted/CustomLoss')" in message, message
    assert "labels[3] = 17 is not a class id in [0, 5)" in message, message
    assert rt.host_stream_flushes() == 1 and rt.outstanding_launches() == 0
    debug.check_errors()  # raised once


def test_check_errors_waits_for_handlers_of_committed_buffers(host_stream):
    # The plugin committed the buffer itself (batching): still in flight when check_errors runs,
    # and its handler runs after the buffer completed.
    rt = host_stream(gpu_seconds=0.05, handler_seconds=0.2)
    encode(rt, make_record(1, -4), node="in_flight/CustomLoss")
    rt.host_stream_commit()
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"node 'in_flight/CustomLoss'.*"
                       r"labels\[1\] = -4"):
        debug.check_errors()
    assert rt.outstanding_launches() == 0


def test_check_errors_after_clean_launches_raises_nothing_and_leaves_none(host_stream):
    rt = host_stream(gpu_seconds=0.0, handler_seconds=0.02)
    for _ in range(3):
        encode(rt, make_record())
    debug.check_errors()
    assert rt.outstanding_launches() == 0 and not debug.has_pending_error()
    assert rt.host_stream_flushes() == 1


def test_check_errors_with_nothing_outstanding_flushes_nothing(host_stream):
    # What the CPU path always is: no launch outstanding, so no GPU synchronization at all.
    rt = host_stream()
    debug.check_errors()
    run_cpu_op()
    debug.check_errors()
    assert rt.host_stream_flushes() == 0 and rt.outstanding_launches() == 0


def test_every_buffer_is_waited_for_one_error_raised_and_the_other_counted(host_stream):
    rt = host_stream(gpu_seconds=0.02, handler_seconds=0.05)
    encode(rt, make_record(2, 50), node="committed")
    rt.host_stream_commit()  # one buffer in flight ...
    encode(rt, make_record(4, 60), node="uncommitted")  # ... and one not committed
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        debug.check_errors()
    # Whichever handler ran first is raised (the model's GPU threads race, as handlers of two
    # buffers may); the other was reported too, so it is counted, and nothing is left.
    message = str(info.value)
    assert re.search(r"node '(un)?committed'\): labels\[[24]\] = [56]0 is not", message), message
    assert "1 later GPU error was dropped" in message, message
    assert rt.outstanding_launches() == 0 and not debug.has_pending_error()


def test_check_errors_times_out_when_no_flush_can_commit_the_buffer(host_stream):
    rt = host_stream(flush=False)  # a stream nobody can commit from outside an op
    encode(rt, make_record(5, 9), node="stuck/CustomLoss")
    with pytest.raises(tf.errors.DeadlineExceededError,
                       match=r"1 GPU launch has not reported its error record after 0.2 s"):
        debug.check_errors(timeout=0.2)
    assert rt.outstanding_launches() == 1
    rt.host_stream_commit()  # the plugin's next batch: now it reports
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"node 'stuck/CustomLoss'"):
        debug.check_errors(timeout=10)


def test_a_launch_encoded_during_the_wait_is_not_waited_for(host_stream):
    # Launches begun after check_errors started belong to a later check: one encoded while the
    # first one's handler is pending stays outstanding, uncommitted, and the call still returns.
    rt = host_stream(gpu_seconds=0.0, handler_seconds=0.3)
    encode(rt, make_record())
    started = threading.Event()

    def later_launch():
        started.wait()
        encode(rt, make_record())

    thread = threading.Thread(target=later_launch)
    thread.start()
    started.set()
    debug.check_errors()  # no timeout: it would hang if it waited for the later launch
    thread.join()
    assert rt.outstanding_launches() in (0, 1)


@pytest.mark.parametrize("timeout", [-1, float("nan"), float("inf"), "1", True])
def test_check_errors_refuses_a_bad_timeout(timeout):
    with pytest.raises(ValueError, match=r"timeout must be None or a finite number of seconds "
                       r">= 0, got " + re.escape(repr(timeout))):
        debug.check_errors(timeout=timeout)


def test_emulated_kernel_record_left_in_an_uncommitted_buffer_is_raised_by_check_errors(
        emu, host_stream):
    rng = np.random.default_rng(23)
    n, c = 13, 30
    logits = rng.normal(0.0, 1.0, (n, c)).astype(np.float32)
    labels = rng.integers(0, c, n).astype(np.int64)
    labels[7] = -2
    run = emu.run(direction="forward", logits=mb.storage(logits, "float32"), labels=labels,
                  label_kind="int64")
    assert run.ok, run.error
    rt = host_stream()
    encode(rt, run.error_record.tobytes(), node="emulated/uncommitted", row_dims=(n,),
           num_classes=c)
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        debug.check_errors()
    with pytest.raises(tf.errors.InvalidArgumentError) as cpu_info:
        tf_metal_ops.custom_loss(labels, logits).numpy()
    cpu_detail = re.search(r"labels\[\d+\] = -?\d+ is not a class id in \[0, \d+\)",
                           str(cpu_info.value))
    assert cpu_detail, str(cpu_info.value)
    assert (f"TfMetalOps>CustomLoss (node 'emulated/uncommitted'): {cpu_detail.group(0)}"
            in str(info.value)), (str(info.value), cpu_detail)


def test_a_metal_kernel_op_raises_it_too():
    # A user's kernel shares the check (csrc/metal_kernel_args.cc): an error the GPU found after
    # an earlier op returned fails the next metal_kernel call, once, on the CPU path as well.
    kernel = tf_metal_ops.metal_kernel(
        "pending_copy", ["x"], ["y"],
        "uint i = thread_position_in_grid.x; y[i] = x[i];")
    x = tf.range(4, dtype=tf.float32)

    def call():
        return kernel(inputs=[x], output_shapes=[[4]], output_dtypes=[tf.float32],
                      grid=(4, 1, 1), threadgroup=(4, 1, 1))[0].numpy()

    np.testing.assert_array_equal(call(), x.numpy())  # compiled before the error is recorded
    report(make_record(2, 9), node="model/loss/CustomLoss")
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        call()
    message = str(info.value)
    assert "labels[2] = 9 is not a class id in [0, 5)" in message, message
    assert "metal_kernel" in message, message  # the note names the ops that raise it
    assert not debug.has_pending_error()
    np.testing.assert_array_equal(call(), x.numpy())
