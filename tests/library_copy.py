"""The tests against another build of the native library, without touching the checkout.

The CI configurations that build the library their own way (sanitizers, clang, aarch64 under
qemu) and the installed wheel's venvs run the tests against that build. This script makes the
package copy they import and runs pytest in a process that first checks the copy's library is
the one loaded, so the check costs no TensorFlow import of its own (under qemu, 40 s).

  python tests/library_copy.py make DEST LIBRARY [DIR ...]
      DEST/tf_metal_ops: the checkout's package files without any built library or bytecode,
      then LIBRARY and each DIR (e.g. the emulator sources build_ext installs) copied into it.
  python tests/library_copy.py pytest DEST [--require-symbol NAME] [pytest arguments]
      Imports tf_metal_ops, loads its native library, fails unless that library lies under
      DEST (and, with --require-symbol, unless NAME is defined in the process, e.g. a preloaded
      sanitizer runtime's __asan_init), then runs pytest with the arguments, in this process.
      DEST is where the package to test is imported from: a copy made by `make`, first on
      PYTHONPATH, or the site-packages of a venv the wheel is installed in. Run it from outside
      the checkout, so that neither this process nor the tests' child Pythons import the
      checkout's package.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "tf_metal_ops"
# Whatever a build or a run leaves in the package directory: never part of the copy.
LEFT_OUT = ("_tf_metal_ops*.so", "*.dylib", "__pycache__")


def make(dest: Path, library: Path, extra_dirs: list[Path]) -> None:
    target = dest / "tf_metal_ops"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(PACKAGE, target, ignore=shutil.ignore_patterns(*LEFT_OUT))
    shutil.copy2(library, target / library.name)
    for extra in extra_dirs:
        shutil.copytree(extra, target / extra.name, dirs_exist_ok=True)
    print(f"package copy: {target} with {library.name}")


def run_pytest(dest: Path, args: list[str]) -> int:
    require = []
    while args[:1] == ["--require-symbol"] and len(args) >= 2:
        require.append(args[1])
        args = args[2:]
    import tensorflow as tf

    import tf_metal_ops
    from tf_metal_ops import _native

    _native.load()
    loaded = _native.library_path().resolve()
    if not loaded.is_relative_to(dest.resolve()):
        sys.exit(f"loaded {loaded}, not the copy under {dest}")
    if require:
        import ctypes

        process = ctypes.CDLL(None)
        missing = [name for name in require if not hasattr(process, name)]
        if missing:
            sys.exit(f"not defined in this process: {', '.join(missing)}")
    print(f"loaded: {loaded}\nTensorFlow {tf.__version__}, tf_metal_ops "
          f"{tf_metal_ops.__version__}: {tf_metal_ops.build_info()}", flush=True)

    import pytest

    return pytest.main(args)


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "make":
        make(Path(argv[1]), Path(argv[2]), [Path(d) for d in argv[3:]])
        return 0
    if len(argv) >= 2 and argv[0] == "pytest":
        return run_pytest(Path(argv[1]), argv[2:])
    sys.exit(__doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
