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
set Abseil's level that early, so while TensorFlow loads, file descriptor 2 goes to a temporary
file, and afterwards every line of it except Abseil's banner and its info, warning and error
lines is written to stderr (Python's warnings and tracebacks among them, in their order). A
process that dies while TensorFlow loads loses that file: with TF_CPP_MIN_LOG_LEVEL set, nothing
is held back.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from typing import Iterator

PROGRAM = "tf-metal-ops"
LOG_LEVEL_ENV = "TF_CPP_MIN_LOG_LEVEL"
# Abseil's banner, and its line prefix "<severity><MMDD> <hh:mm:ss.micros> <thread> <file:line>] "
# at severities I, W and E (a fatal line, F, stays). Before its log is initialized, Abseil
# writes the date as 0000 and the whole Unix time as seconds: "I0000 00:00:1796456850.464859".
START_UP_LOG_LINE = re.compile(
    rb"WARNING: All log messages before absl::InitializeLog\(\)"
    rb"|[IWE]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [^ \]]+:\d+\] ")


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
    """`captured` less the lines that START_UP_LOG_LINE matches."""
    return b"".join(line for line in captured.splitlines(keepends=True)
                    if not START_UP_LOG_LINE.match(line))


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
        captured = tempfile.TemporaryFile()
    except OSError:  # no writable temporary directory: TensorFlow's lines stay
        os.close(saved)
        yield
        return
    with captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            if sys.stderr is not None:
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = without_start_up_log(captured.read())
            if kept:
                os.write(2, kept)
