"""The command-line tool's default for TensorFlow's C++ log, applied before TensorFlow loads.

TensorFlow's C++ log prints notices at start-up and, with Keras 3 on recent TensorFlow, an
error-level "NodeDef mentions attribute use_unbounded_threadpool" line whenever tf.data runs: to
a newcomer running the tool, errors of ours. Real failures arrive as Python exceptions, so the
tool shows only fatal lines unless the user set TF_CPP_MIN_LOG_LEVEL. The level is read when
TensorFlow loads, and the package's ``__init__`` loads TensorFlow before ``__main__`` or
``cli`` runs, so ``__init__`` calls this first; a program that merely imports tf_metal_ops keeps
TensorFlow's defaults.
"""

from __future__ import annotations

import os
import sys

PROGRAM = "tf-metal-ops"


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


def quiet_tensorflow_log_for_command() -> None:
    if invoked_as_command():
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
