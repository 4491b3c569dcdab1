"""The command-line tool's quiet TensorFlow start-up, applied while the package loads TensorFlow.

TensorFlow's C++ log prints notices at start-up and, with Keras 3 on recent TensorFlow, an
error-level "NodeDef mentions attribute use_unbounded_threadpool" line whenever tf.data runs: to
a newcomer running the tool, messages of ours. Real failures arrive as Python exceptions, so the
tool shows only fatal lines unless the user set TF_CPP_MIN_LOG_LEVEL. That level is read when
TensorFlow loads, and the package's ``__init__`` loads TensorFlow before ``__main__`` or ``cli``
runs, so ``__init__`` loads it inside ``quiet_tensorflow_log_for_command()``; a program that
merely imports tf_metal_ops keeps TensorFlow's defaults.

The level does not reach every line. TensorFlow logs through Abseil, and its libraries log from
static initializers (x86-64: "oneDNN custom operations are on", once per library) before
TensorFlow applies TF_CPP_MIN_LOG_LEVEL and before anything calls ``absl::InitializeLog()``:
Abseil writes those to stderr whatever the level, after its banner "WARNING: All log messages
before absl::InitializeLog() is called are written to STDERR". Nothing outside the process can
set Abseil's level that early, so while TensorFlow loads, file descriptor 2 is a pipe into a
filter process (tf_metal_ops/_start_up_log_filter.py) that passes every line but Abseil's banner
and its info, warning and error lines to the real stderr, in their order (Python's warnings and
tracebacks among them). A process of its own, not a thread: when TensorFlow's load kills the
tool (a fatal "Check failed" line, then abort), the filter still writes that line.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from typing import Iterator

from tf_metal_ops import _start_up_log_filter

PROGRAM = "tf-metal-ops"
LOG_LEVEL_ENV = "TF_CPP_MIN_LOG_LEVEL"


def invoked_as_command() -> bool:
    """Whether this process is `python -m tf_metal_ops ...` or the `tf-metal-ops` script."""
    argv0 = sys.argv[0] if sys.argv else ""
    if os.path.basename(argv0) in (PROGRAM, PROGRAM + ".exe"):
        return True
    # Python sets argv[0] to "-m" while it imports the packages of `python -m <module>`.
    if argv0 != "-m":
        return False
    orig = getattr(sys, "orig_argv", None)  # Python >= 3.10
    if not orig or "-m" not in orig[:-1]:
        return True
    target = orig[orig.index("-m") + 1]
    return target == "tf_metal_ops" or target.startswith("tf_metal_ops.")


@contextlib.contextmanager
def quiet_tensorflow_log_for_command() -> Iterator[None]:
    """Around the code that loads TensorFlow: for the command, unless the user set
    TF_CPP_MIN_LOG_LEVEL, TensorFlow's C++ log at fatal lines only and its start-up lines held
    back from stderr."""
    if not invoked_as_command() or LOG_LEVEL_ENV in os.environ:
        yield
        return
    os.environ[LOG_LEVEL_ENV] = "3"
    with _stderr_without_start_up_log():
        yield


def without_start_up_log(captured: bytes) -> bytes:
    """`captured` less the lines that the filter process holds back."""
    return b"".join(line for line in captured.splitlines(keepends=True)
                    if not _start_up_log_filter.is_start_up_log_line(line))


@contextlib.contextmanager
def _stderr_without_start_up_log() -> Iterator[None]:
    if sys.stderr is not None:
        sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no file descriptor 2: nothing reaches a user anyway
        yield
        return
    try:
        read_end, write_end = os.pipe()
    except OSError:
        os.close(saved)
        yield
        return
    try:
        # -I -S: the filter needs only the standard library; the user's environment and site
        # packages would only slow its start.
        log_filter = subprocess.Popen(
            [sys.executable, "-I", "-S", _start_up_log_filter.__file__],
            stdin=read_end, stdout=saved, stderr=saved)
    except (OSError, ValueError):  # no interpreter to start (an embedded Python): lines stay
        for fd in (read_end, write_end, saved):
            os.close(fd)
        yield
        return
    os.close(read_end)
    os.dup2(write_end, 2)
    os.close(write_end)
    try:
        yield
    finally:
        if sys.stderr is not None:
            sys.stderr.flush()
        os.dup2(saved, 2)  # closes this process's last end of the pipe: the filter drains, exits
        os.close(saved)
        # Waited for, so that its lines come before whatever the tool writes next.
        try:
            log_filter.wait(timeout=30)
        except subprocess.TimeoutExpired:
            # A child process TensorFlow started holds the pipe open: the filter goes on beside
            # the tool and ends with that child.
            pass
