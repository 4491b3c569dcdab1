"""Checks the cross-linked macOS arm64 native library with LLVM's Mach-O tools.

    python check_macos_bundle.py BUNDLE LIBTENSORFLOW_FRAMEWORK [--llvm-suffix -19]

What a Mac's dynamic loader would hold against the bundle, checked without a Mac:
  1. it is a 64-bit arm64 Mach-O bundle (MH_BUNDLE) with two-level namespace bindings;
  2. it loads exactly @rpath/libtensorflow_framework.2.dylib, Foundation, Metal, Accelerate,
     libobjc, libc++ and libSystem, with @loader_path/../tensorflow as its rpath (where pip puts
     TensorFlow next to tf_metal_ops);
  3. every symbol it imports is bound to one of those libraries by name, except Python's own
     (_Py*, looked up in the interpreter that loads it): no other flat-namespace binding;
  4. every TF_* symbol it imports is exported by that libtensorflow_framework.2.dylib;
  5. it is an Objective-C image of Apple's runtime built with ARC (an __objc_imageinfo section,
     objc_msgSend and ARC's objc_storeStrong / objc_retainAutoreleasedReturnValue bound from
     libobjc, NSString, NSURL and MTLCompileOptions from Foundation and Metal), carries its own
     ___isPlatformVersionAtLeast for @available, and exports PyInit__tf_metal_ops;
  6. it holds metal_kernel's Metal encoder: the registration function of TfMetalOps>MetalKernel's
     GPU kernel, TF_KernelBuilder_HostMemory from TensorFlow, the dispatchThreads selector and
     the init_value fill kernels' source;
  7. its matrix products bind to Accelerate's BLAS: cblas_sgemm's current (ACCELERATE_NEW_LAPACK)
     entry point _cblas_sgemm$NEWLAPACK from Accelerate, weakly (it exists from macOS 13.3 on,
     and csrc/cpu/gemm.cc checks for it before calling), and no other BLAS symbol.
Prints one line per check; exits 1 with every failed check named.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

EXPECTED_DYLIBS = {
    "@rpath/libtensorflow_framework.2.dylib",
    "/System/Library/Frameworks/Foundation.framework/Versions/C/Foundation",
    "/System/Library/Frameworks/Metal.framework/Versions/A/Metal",
    "/System/Library/Frameworks/Accelerate.framework/Versions/A/Accelerate",
    "/usr/lib/libobjc.A.dylib",
    "/usr/lib/libc++.1.dylib",
    "/usr/lib/libSystem.B.dylib",
}
# llvm-nm -m names a library by its install name's leaf, without version suffixes.
LIBRARY_NAMES = {"libtensorflow_framework", "Foundation", "Metal", "Accelerate", "libobjc",
                 "libc++", "libSystem"}
SGEMM = "_cblas_sgemm$NEWLAPACK"
RPATH = "@loader_path/../tensorflow"
# tf_metal_ops::metal::RegisterMetalKernelForAppleStream(), as Mach-O names it.
METAL_KERNEL_REGISTRATION = "__ZN12tf_metal_ops5metal33RegisterMetalKernelForAppleStreamEv"
PYTHON_SYMBOL = re.compile(r"^__?Py")
# `(undefined) external _TF_NewStatus (from libtensorflow_framework)`
IMPORT = re.compile(r"^\s*\(undefined\) (weak )?external (\S+) \((.+)\)$")


class Checker:
    def __init__(self, suffix: str) -> None:
        self.suffix = suffix
        self.failures: list[str] = []
        self.passed: list[str] = []

    def tool(self, name: str, *args: str) -> str:
        command = [f"{name}{self.suffix}", *args]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            sys.exit(f"check_macos_bundle: {' '.join(command)} failed:\n{result.stderr}")
        return result.stdout

    def expect(self, name: str, ok: bool, detail: str) -> None:
        (self.passed if ok else self.failures).append(name)
        print(f"  {'ok  ' if ok else 'FAIL'} {name}: {detail}")


def check(bundle: Path, framework: Path, checker: Checker) -> None:
    header = checker.tool("llvm-objdump", "--macho", "--private-header", str(bundle))
    fields = header.split()
    checker.expect("arm64 bundle", "MH_MAGIC_64" in fields and "ARM64" in fields
                   and "BUNDLE" in fields, header.strip().splitlines()[-1].strip())
    checker.expect("two-level namespace", "TWOLEVEL" in fields, "TWOLEVEL flag in the header")

    used = checker.tool("llvm-objdump", "--macho", "--dylibs-used", str(bundle)).splitlines()[1:]
    dylibs = {line.strip().split(" (compatibility")[0] for line in used if line.strip()}
    checker.expect("load commands", dylibs == EXPECTED_DYLIBS,
                   ", ".join(sorted(dylibs)) + (
                       "" if dylibs == EXPECTED_DYLIBS else
                       f"; missing {sorted(EXPECTED_DYLIBS - dylibs)}, "
                       f"unexpected {sorted(dylibs - EXPECTED_DYLIBS)}"))
    load_commands = checker.tool("llvm-objdump", "--macho", "--private-headers", str(bundle))
    rpaths = re.findall(r"cmd LC_RPATH\n\s+cmdsize \d+\n\s+path (\S+)", load_commands)
    checker.expect("rpath", rpaths == [RPATH], f"LC_RPATH {rpaths}")

    imports: dict[str, str] = {}
    weak: set[str] = set()
    for line in checker.tool("llvm-nm", "-m", "-u", str(bundle)).splitlines():
        match = IMPORT.match(line)
        if match:
            imports[match.group(2)] = match.group(3)
            if match.group(1):
                weak.add(match.group(2))
    flat = sorted(s for s, where in imports.items() if where == "dynamically looked up"
                  and not PYTHON_SYMBOL.match(s))
    python = [s for s, where in imports.items() if where == "dynamically looked up"
              and PYTHON_SYMBOL.match(s)]
    elsewhere = sorted(f"{s} ({where})" for s, where in imports.items()
                       if where != "dynamically looked up"
                       and where.removeprefix("from ") not in LIBRARY_NAMES)
    checker.expect("no flat-namespace binding but Python's", not flat and not elsewhere,
                   f"{len(imports) - len(python)} symbols bound by library, {len(python)} _Py* "
                   "left to the interpreter" + (f"; flat: {flat[:20]}" if flat else "")
                   + (f"; unknown library: {elsewhere[:20]}" if elsewhere else ""))
    # The bind opcodes themselves: a flat-namespace bind names no library ordinal.
    binds = checker.tool("llvm-objdump", "--macho", "--bind", "--lazy-bind", str(bundle))
    flat_binds = sorted({line.split()[-1] for line in binds.splitlines()
                         if " flat-namespace " in line
                         and not PYTHON_SYMBOL.match(line.split()[-1])})
    checker.expect("bind opcodes", not flat_binds,
                   f"flat-namespace binds outside _Py*: {flat_binds[:20]}" if flat_binds
                   else "no flat-namespace bind outside _Py*")

    exported = set(checker.tool("llvm-nm", "-g", "--defined-only", "-j", str(framework)).split())
    tf_imports = sorted(s for s in imports if s.startswith("_TF_"))
    missing = [s for s in tf_imports if s not in exported]
    misbound = [s for s in tf_imports if imports[s] != "from libtensorflow_framework"]
    checker.expect("TF_* symbols", bool(tf_imports) and not missing and not misbound,
                   f"not exported: {missing}; not bound to it: {misbound}" if missing or misbound
                   else f"{len(tf_imports)} imported, all exported by {framework.name}")

    sections = checker.tool("llvm-objdump", "--macho", "--section-headers", str(bundle))
    classes = {c: imports.get(f"_OBJC_CLASS_$_{c}")
               for c in ("NSString", "NSURL", "MTLCompileOptions")}
    # ARC's own entry points (clang emits them only under -fobjc-arc), from Apple's libobjc.
    arc = {f: imports.get(f) for f in ("_objc_storeStrong", "_objc_retainAutoreleasedReturnValue")}
    apple_runtime = ("__objc_imageinfo" in sections
                     and imports.get("_objc_msgSend") == "from libobjc"
                     and set(arc.values()) == {"from libobjc"}
                     and classes == {"NSString": "from Foundation", "NSURL": "from Foundation",
                                     "MTLCompileOptions": "from Metal"})
    checker.expect("Apple Objective-C runtime with ARC", apple_runtime,
                   f"__objc_imageinfo, objc_msgSend {imports.get('_objc_msgSend')}, ARC {arc}, "
                   f"classes {classes}")
    defined = checker.tool("llvm-nm", "-m", "--defined-only", str(bundle))
    # Hidden in the bundle, as compiler-rt's copy is: "non-external (was a private external)".
    own_platform_check = re.search(r"\) non-external .*___isPlatformVersionAtLeast$", defined,
                                   re.MULTILINE) is not None
    checker.expect("@available support", own_platform_check
                   and imports.get("__availability_version_check") == "from libSystem",
                   "___isPlatformVersionAtLeast defined inside, _availability_version_check "
                   f"{imports.get('__availability_version_check')}")
    blas = sorted(s for s in imports if "cblas" in s or s.lstrip("_").startswith("scipy_"))
    checker.expect("BLAS from Accelerate",
                   imports.get(SGEMM) == "from Accelerate" and SGEMM in weak and blas == [SGEMM],
                   f"{SGEMM} {imports.get(SGEMM)}{' (weak)' if SGEMM in weak else ''}; "
                   f"BLAS imports {blas}")
    # tf_metal_ops.metal_kernel's Metal encoder (csrc/metal/metal_kernel_metal.mm) is linked in:
    # its registration function, TF_KernelBuilder_HostMemory (only that registration uses it),
    # the selector it dispatches with and the source of its init_value fill kernels.
    contents = bundle.read_bytes()
    strings = {s: s.encode() in contents
               for s in ("dispatchThreads:threadsPerThreadgroup:", "tfmo_fill_32")}
    # Defined in the code section; hidden, like all our symbols but the module's entry point.
    registration = re.search(r"^\S+ \(__TEXT,__text\) .*\b" + re.escape(METAL_KERNEL_REGISTRATION)
                             + "$", defined, re.MULTILINE) is not None
    host_memory = imports.get("_TF_KernelBuilder_HostMemory")
    checker.expect("metal_kernel GPU encoder",
                   registration and host_memory == "from libtensorflow_framework"
                   and all(strings.values()),
                   f"{METAL_KERNEL_REGISTRATION} {'defined' if registration else 'MISSING'}, "
                   f"_TF_KernelBuilder_HostMemory {host_memory}, strings {strings}")
    exports = checker.tool("llvm-objdump", "--macho", "--exports-trie", str(bundle))
    checker.expect("module entry point", "_PyInit__tf_metal_ops" in exports.split(),
                   "_PyInit__tf_metal_ops exported")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("framework", type=Path, help="libtensorflow_framework.2.dylib")
    parser.add_argument("--llvm-suffix", default="-19")
    args = parser.parse_args()
    checker = Checker(args.llvm_suffix)
    print(f"check_macos_bundle: {args.bundle.name}")
    check(args.bundle, args.framework, checker)
    if checker.failures:
        sys.exit(f"check_macos_bundle: {len(checker.failures)} check(s) failed: "
                 + ", ".join(checker.failures))
    print(f"check_macos_bundle: {len(checker.passed)} checks passed: {', '.join(checker.passed)}")


if __name__ == "__main__":
    main()
