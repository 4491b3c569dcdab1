"""Takes from TensorFlow's macOS arm64 wheel only what the cross-build of the native library needs.

    python extract_tf_macos.py WHEEL DESTINATION

DESTINATION/tensorflow/ then looks like the installed package as setup.py sees it:
  - libtensorflow_framework.2.dylib, the real library the bundle links against;
  - include/: the C API headers (tensorflow/c/{kernels,ops,tf_status,tf_tensor}.h) and every
    header they include, transitively (found by reading their `#include "..."` lines, so a
    TensorFlow version that moves a header still extracts what it needs);
  - include/external/local_config_python/python_include/: the CPython headers this wheel was
    built with (macOS ones, with the macOS pyconfig.h), which pybind11 needs.
Everything else in the wheel (about 1.3 GB unpacked) is left out.
"""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path

PACKAGE = "tensorflow/"
INCLUDE = PACKAGE + "include/"
FRAMEWORK = PACKAGE + "libtensorflow_framework.2.dylib"
PYTHON_INCLUDE = INCLUDE + "external/local_config_python/python_include/"
# The TensorFlow headers csrc/ includes (csrc/tf_c.h and csrc/ops.cc).
ROOT_HEADERS = ("tensorflow/c/kernels.h", "tensorflow/c/ops.h", "tensorflow/c/tf_status.h",
                "tensorflow/c/tf_tensor.h")
QUOTED_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def header_closure(wheel: zipfile.ZipFile, names: set[str]) -> set[str]:
    """The wheel paths of ROOT_HEADERS and of every quoted include they reach."""
    found: set[str] = set()
    pending = list(ROOT_HEADERS)
    while pending:
        header = pending.pop()
        path = INCLUDE + header
        if path in found:
            continue
        if path not in names:
            # A bare name (TargetConditionals.h, under #ifdef __APPLE__) is a system header.
            if "/" not in header:
                continue
            sys.exit(f"extract_tf_macos: the wheel has no {path}, which the C API headers include")
        found.add(path)
        text = wheel.read(path).decode("utf-8", errors="replace")
        pending.extend(QUOTED_INCLUDE.findall(text))
    return found


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    wheel_path, destination = Path(sys.argv[1]), Path(sys.argv[2])
    with zipfile.ZipFile(wheel_path) as wheel:
        names = set(wheel.namelist())
        if FRAMEWORK not in names:
            sys.exit(f"extract_tf_macos: {wheel_path.name} has no {FRAMEWORK}")
        python_headers = {n for n in names if n.startswith(PYTHON_INCLUDE) and not n.endswith("/")}
        if PYTHON_INCLUDE + "Python.h" not in python_headers:
            sys.exit(f"extract_tf_macos: {wheel_path.name} has no {PYTHON_INCLUDE}Python.h")
        wanted = {FRAMEWORK} | python_headers | header_closure(wheel, names)
        for name in sorted(wanted):
            wheel.extract(name, destination)
    print(f"extract_tf_macos: {len(wanted)} files from {wheel_path.name}")


if __name__ == "__main__":
    main()
