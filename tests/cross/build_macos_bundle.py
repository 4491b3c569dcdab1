"""Compiles and links the native library as a macOS arm64 bundle, with setup.py's own settings.

    python build_macos_bundle.py --sdk DIR --tensorflow DIR --tf-version V --work DIR --out FILE

Run by tests/cross/macos_arm64_build.sh, which prepares the directories (see its header). The
sources, macros, include directories, compile flags (pybind11's among them) and link arguments
all come from setup.py's native_extension(MACOS_ARM64, ...), the function setup() itself builds
from on a Mac; -fobjc-arc for the .mm files from setup.OBJC_COMPILE_ARGS. What this file adds is
what a Mac's toolchain would supply by itself, each noted where it is added.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO))
import setup  # noqa: E402  (setup.py: importing it builds nothing)

# The deployment target the real build ends up with on Apple silicon: pybind11 asks for
# -mmacosx-version-min=10.14, which clang raises to 11.0, the first macOS on arm64.
# TensorFlow's dylib says 12.0, which lld notes in a warning (as a Mac's ld64 would).
DEPLOYMENT_TARGET = "11.0"
TARGET = f"arm64-apple-macos{DEPLOYMENT_TARGET}"
# Python's own symbols are left to the interpreter that loads the bundle (as every extension
# module does); everything else must resolve at link time.
PYTHON_SYMBOL = re.compile(r"^__?Py")


def run(command: list[str]) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        sys.exit(f"build_macos_bundle: failed ({result.returncode}): {' '.join(command)}\n"
                 f"{result.stdout}{result.stderr}")
    # Warnings are shown, not hidden: e.g. lld's note that TensorFlow's dylib targets a newer macOS.
    if result.stderr.strip():
        print(result.stderr.strip())
    return result


def link_arguments(extra_link_args: list[str]) -> list[str]:
    """setup.py's link arguments as ld64 takes them (clang's driver would unwrap -Wl, the same)."""
    arguments: list[str] = []
    for argument in extra_link_args:
        if argument.startswith("-Wl,"):
            arguments += argument[len("-Wl,"):].split(",")
        else:
            arguments.append(argument)
    return arguments


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sdk", type=Path, required=True)
    parser.add_argument("--tensorflow", type=Path, required=True)
    parser.add_argument("--tf-version", required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--clang", default="clang++-19")
    parser.add_argument("--ld", default="ld64.lld-19")
    parser.add_argument("--nm", default="llvm-nm-19")
    parser.add_argument("--libcxx-headers", type=Path,
                        default=Path("/usr/lib/llvm-19/include/c++/v1"))
    parser.add_argument("--apple-decls", type=Path, required=True,
                        help="directory with Foundation/, Metal/ and dispatch/ headers")
    parser.add_argument("--sdk-version", required=True, help="the SDK the headers come from")
    parser.add_argument("--flat-probe", type=Path,
                        help="also link this bundle the loose way (see below), for the checker's "
                             "negative test")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()

    ext = setup.native_extension(setup.MACOS_ARM64, args.tensorflow, args.tf_version)
    # No .metallib can be built off a Mac: MetalBuildExt then defines this macro so.
    define_macros = [*ext.define_macros, setup.kernel_library_macro(precompiled=False)]
    python_include = args.tensorflow / "include/external/local_config_python/python_include"

    common = [
        args.clang, f"--target={TARGET}", "-isysroot", str(args.sdk),
        # libc++ with Apple's configuration (our __config_site first), as in Apple's SDK.
        "-nostdinc++", "-isystem", str(HERE / "macos_libcxx"), "-isystem", str(args.libcxx_headers),
        # Our documented declarations of Foundation, Metal and libdispatch (no Apple SDK here);
        # everything else (<dlfcn.h>, the C library) is macOS's own from the SDK directory.
        "-I", str(args.apple_decls),
        *(f"-I{d}" for d in ext.include_dirs),
        # distutils adds the Python headers from sysconfig on a Mac; these are the macOS ones.
        "-I", str(python_include),
        *(f"-D{name}" if value is None else f"-D{name}={value}" for name, value in define_macros),
    ]
    objects_dir = args.work / "objects"
    objects_dir.mkdir(parents=True, exist_ok=True)

    def compile_one(source: str) -> Path:
        path = REPO / source
        obj = objects_dir / (source.replace("/", "_") + ".o")
        objc = setup.OBJC_COMPILE_ARGS if path.suffix == ".mm" else []
        run([*common, *ext.extra_compile_args, *objc, "-c", str(path), "-o", str(obj)])
        return obj

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        objects = list(pool.map(compile_one, ext.sources))
    print(f"build_macos_bundle: compiled {len(objects)} sources "
          f"({sum(s.endswith('.mm') for s in ext.sources)} Objective-C++) for {TARGET}")

    # compiler-rt's ___isPlatformVersionAtLeast (for @available), which a Mac's clang links in.
    platform_version = objects_dir / "macos_platform_version.o"
    run([args.clang.replace("clang++", "clang"), f"--target={TARGET}", "-isysroot", str(args.sdk),
         "-O2", "-c", str(HERE / "macos_platform_version.c"), "-o", str(platform_version)])

    undefined = run([args.nm, "-u", "--extern-only", *map(str, objects)]).stdout.split()
    python_symbols = sorted({s for s in undefined if PYTHON_SYMBOL.match(s)})
    def link(out: Path, undefined_policy: list[str], runtime_libraries: list[str]) -> None:
        run([
            args.ld, "-arch", "arm64", "-platform_version", "macos", DEPLOYMENT_TARGET,
            args.sdk_version, "-syslibroot", str(args.sdk), "-bundle", *undefined_policy,
            "-o", str(out), *map(str, objects), str(platform_version),
            *link_arguments(ext.extra_link_args), *runtime_libraries,
        ])

    # clang's driver adds -lc++ and -lSystem to every C++ link on a Mac. libobjc comes in on a Mac
    # through Foundation (ld64 links public indirect libraries); named here so that the runtime's
    # functions bind to it by name.
    link(args.out,
         ["-undefined", "error", *(a for symbol in python_symbols for a in ("-U", symbol))],
         ["-lobjc", "-lc++", "-lSystem"])
    print(f"build_macos_bundle: linked {args.out.name} with -undefined error "
          f"({len(python_symbols)} Python symbols left to the interpreter)")
    if args.flat_probe:
        # Python's own LDSHARED on a Mac (-undefined dynamic_lookup), without libobjc: it links,
        # with the Objective-C runtime's functions bound by flat lookup. The checker must refuse it.
        link(args.flat_probe, ["-undefined", "dynamic_lookup"], ["-lc++", "-lSystem"])


if __name__ == "__main__":
    main()
