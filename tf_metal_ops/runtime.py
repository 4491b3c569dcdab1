"""The commit mode of the Metal kernels and the CPU thread limit: process-wide settings held by
the native library, read by each op execution (so no `tf.function` is retraced). The thread
limit follows `tf.config.threading.set_intra_op_parallelism_threads` unless `set_cpu_threads`
sets one."""

from __future__ import annotations

import contextlib
from typing import Iterator

from tf_metal_ops import _native

COMMIT_MODES = ("commit", "commit_and_wait")


def set_commit_mode(mode: str) -> None:
    """Sets how the GPU kernels hand their work to the Metal stream.

    Args:
        mode: `"commit"` (default: encode on the plugin's command buffer and let it batch
            commits) or `"commit_and_wait"` (commit and wait after every kernel, so a GPU error
            or a bad label surfaces at the op that caused it, and GPU times are recorded).

    On a machine without the Metal kernels the setting is kept but changes nothing: the CPU
    kernels always finish before the op returns.
    """
    if mode not in COMMIT_MODES:
        raise ValueError(f"mode must be one of {COMMIT_MODES}, got {mode!r}")
    _native.runtime().set_commit_mode(mode)


def get_commit_mode() -> str:
    """Returns the current commit mode, `"commit"` or `"commit_and_wait"`."""
    return _native.runtime().get_commit_mode()


@contextlib.contextmanager
def commit_and_wait() -> Iterator[None]:
    """Runs the block in `"commit_and_wait"` mode and restores the previous mode after it."""
    previous = get_commit_mode()
    set_commit_mode("commit_and_wait")
    try:
        yield
    finally:
        set_commit_mode(previous)


def metal_available() -> bool:
    """True when this build has the Metal kernels compiled in (macOS builds)."""
    return bool(_native.runtime().build_info()["metal_compiled_in"])


# True once set_cpu_threads gave a cap of its own; until then the cap follows TensorFlow's.
_explicit_cpu_threads = False


def _tensorflow_intra_op_threads() -> int:
    import tensorflow as tf

    return int(tf.config.threading.get_intra_op_parallelism_threads())


def set_cpu_threads(threads: int) -> None:
    """Caps the threads one CPU kernel execution uses.

    Args:
        threads: the cap, or 0 (the default) to follow TensorFlow's own setting,
            `tf.config.threading.set_intra_op_parallelism_threads`, and use all cores where
            that is 0 too.
    """
    global _explicit_cpu_threads
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise ValueError(f"threads must be an int >= 0 (0: as TensorFlow's intra-op threads), "
                         f"got {threads!r}")
    _explicit_cpu_threads = threads > 0
    _native.runtime().set_cpu_threads(threads if threads > 0 else _tensorflow_intra_op_threads())


def get_cpu_threads() -> int:
    """Returns the thread cap of the CPU kernels (the core count when no cap applies)."""
    return int(_native.runtime().get_cpu_threads())


def follow_tensorflow_threads() -> None:
    """Called wherever a CustomLoss op is made: unless `set_cpu_threads` gave a cap, the CPU
    kernels use as many threads as TensorFlow's intra-op pool is configured to (the C API gives
    a kernel no access to that pool, so this is read on the Python side)."""
    if not _explicit_cpu_threads:
        _native.runtime().set_cpu_threads(_tensorflow_intra_op_threads())
