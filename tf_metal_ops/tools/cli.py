"""`python -m tf_metal_ops` / `tf-metal-ops`: info, check, demo, bench.

    tf-metal-ops info [--json]        versions, devices, registered kernels, native build
    tf-metal-ops check [--quick] [--json] [--dtype D[,D...]]
                                      CustomLoss forward + gradient on every device vs the
                                      NumPy reference
    tf-metal-ops demo [--epochs N] [--plot out.png] [--seed S] [--jit-compile]
                                      train a small CNN on scikit-learn's 8x8 digits
    tf-metal-ops bench [--quick] [--json] [--sizes NxC,...] ...
                                      CPU timings against TensorFlow's and Keras's losses
                                      (tf_metal_ops/tools/bench/)

Exit codes (also in `--help`):
    0  success
    1  `check` found a disagreement (some case FAILed)
    2  usage error: unknown command or flag, bad value (argparse prints the usage)
    3  environment problem: TensorFlow missing or too old, native library missing or built
       for another TensorFlow, matplotlib missing for `--plot`; one sentence on stderr, no
       traceback
A failure of `check` (1) is kept apart from "could not run at all" (3) so that CI can tell a
numerical regression from a broken installation.

Arguments are parsed before TensorFlow is imported, so usage errors are instant and a broken
TensorFlow cannot turn `--help` into a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable, Sequence

from tf_metal_ops._command_line import PROGRAM as PROG
from tf_metal_ops.tools.arguments import positive_int, whole_number

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2
EXIT_ENVIRONMENT = 3


DTYPES = ("float16", "bfloat16", "float32", "float64")

_EPILOG = """exit codes: 0 success; 1 check found a FAIL; 2 usage error; 3 environment problem
(TensorFlow or the native library missing or incompatible; one sentence on stderr)"""


# ---------------------------------------------------------------------------------------------
# Argument types: a wrong value is a usage error (exit 2) with the argument named.


def _dtype_list(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected one or more of " + ", ".join(DTYPES))
    for name in names:
        if name not in DTYPES:
            raise argparse.ArgumentTypeError(
                f"unknown dtype {name!r}; choose from {', '.join(DTYPES)}")
    return names


def _seed(text: str) -> int:
    return whole_number(text, 0, 2**32)


def _png_path(text: str) -> str:
    if not text.lower().endswith(".png"):
        raise argparse.ArgumentTypeError(f"the plot is a PNG file: expected a path ending in "
                                         f".png, got {text!r}")
    directory = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(f"directory {directory!r} for {text!r} does not exist")
    return text


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every command."""
    parser = argparse.ArgumentParser(
        prog=PROG, epilog=_EPILOG,
        description="tf_metal_ops: a fused focal / label-smoothed cross-entropy op for "
                    "TensorFlow, with CPU and Apple-GPU (Metal) kernels.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    info = commands.add_parser(
        "info", epilog=_EPILOG,
        help="versions, devices, registered kernels and native build (paste into bug reports)")
    info.add_argument("--json", action="store_true", help="print JSON instead of text")

    check = commands.add_parser(
        "check", epilog=_EPILOG,
        help="CustomLoss forward and gradient on every device vs the NumPy reference")
    check.add_argument("--quick", action="store_true",
                       help="a small subset of the case matrix (a few seconds)")
    check.add_argument("--json", action="store_true", help="print JSON instead of a table")
    check.add_argument("--dtype", type=_dtype_list, action="append", metavar="D[,D...]",
                       help=f"logits dtype(s) to check, repeatable; default all: "
                            f"{', '.join(DTYPES)}")

    demo = commands.add_parser(
        "demo", epilog=_EPILOG,
        help="train a small CNN with CustomLoss on scikit-learn's handwritten digits")
    demo.add_argument("--epochs", type=positive_int, default=None, metavar="N",
                      help="training epochs (default: the demo's tuned value)")
    demo.add_argument("--plot", type=_png_path, default=None, metavar="OUT.png",
                      help="also save the training curves as a PNG (needs matplotlib)")
    demo.add_argument("--seed", type=_seed, default=0, metavar="S",
                      help="random seed: the same seed prints the same figures (default 0)")
    demo.add_argument("--jit-compile", action="store_true",
                      help="compile training with XLA (Keras jit_compile=True): the loss then "
                           "runs as composed TensorFlow ops (default: Keras's \"auto\")")

    from tf_metal_ops.tools.bench import suite  # noqa: PLC0415  (standard library only at import)

    commands.add_parser(
        "bench", epilog=_EPILOG, parents=[suite.build_parser(add_help=False)],
        help="time the CPU kernels against TensorFlow's and Keras's losses and the memory floor")
    return parser


def _command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:  # argparse keeps subparsers here; there is no public getter
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(command, parser)
    return parser


# ---------------------------------------------------------------------------------------------
# Commands


def _cmd_info(args: argparse.Namespace) -> int:
    from tf_metal_ops.tools import environment  # noqa: PLC0415 - TensorFlow only after parsing

    info = environment.describe()
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=False))
    else:
        print(format_info(info))
    if info["problem"]:
        # Everything else was still printed (it is what a bug report needs); the problem is
        # the one sentence on stderr, and the exit code says the package cannot run.
        print(f"{PROG}: {info['problem']}", file=sys.stderr)
        return EXIT_ENVIRONMENT
    return EXIT_OK


def format_info(info: dict[str, Any]) -> str:
    """The text form of `environment.describe()`."""
    py = info["python"]
    tf_info = info["tensorflow"]
    keras = info["keras"]
    lines = [
        ("tf_metal_ops", f"{info['tf_metal_ops']['version']} ({info['tf_metal_ops']['location']})"),
        ("Python", f"{py['version']} ({py['implementation']}, {py['executable']})"),
        ("Platform", info["platform"]),
        ("TensorFlow", tf_info["version"]
         + (f" (distribution {tf_info['distribution']})" if tf_info["distribution"] else "")),
        ("Keras", str(keras["version"])
         + (f" (backend {keras['backend']})" if keras["backend"] else "")),
        ("tensorflow-metal", info["tensorflow_metal"] or "not installed"),
        ("Devices", ", ".join(f"{d['name']}" for d in info["devices"]) or "none"),
    ]
    gpu = any(d["type"] == "GPU" for d in info["devices"])
    if not gpu:
        lines.append(("", "no GPU found: our ops run on the CPU only"))
    lines.append(("Kernels registered", "(asked from TensorFlow's kernel registry)"))
    for op, kernels in info["kernels"].items():
        if isinstance(kernels, str):
            lines.append((f"  {op}", kernels))
            continue
        if not kernels:
            lines.append((f"  {op}", "no kernel registered on any device"))
            continue
        by_device: dict[str, set[str]] = {}
        for k in kernels:
            by_device.setdefault(k["device_type"], set()).update(k["constraints"].get("T", []))
        text = "; ".join(f"{dev} (T: {', '.join(sorted(ts)) or 'all the op allows'})"
                         for dev, ts in sorted(by_device.items()))
        lines.append((f"  {op}", text))
    lines.append(("Native library", info["native_library"]
                  or ("not loaded" if info.get("problem") else "not found")))
    build = info["build_info"]
    if isinstance(build, dict):
        lines.append(("Build info", ""))
        lines.extend((f"  {k}", str(v)) for k, v in build.items() if k != "library_path")
    else:
        lines.append(("Build info", str(build)))
    no_gpu = " (no Metal GPU here: the setting changes nothing on the CPU)"
    real_mode = info["commit_mode"] in ("commit", "commit_and_wait")
    lines.append(("Commit mode", info["commit_mode"] + ("" if gpu or not real_mode else no_gpu)))
    paths = info.get("loss_path")
    if isinstance(paths, dict):
        if paths.get("gpu_plugin"):
            lines.append(("GPU plugin", paths["gpu_plugin"]["reason"]))
        lines.append(("Loss path", paths["where"]))
        made = ", ".join(f"{path} {n}" for path, n in paths["counts"].items() if n)
        if made:
            lines.append(("  made so far", made + (f" (last: {paths['last']['reason']})"
                                                   if paths.get("last") else "")))
    elif paths is not None:
        lines.append(("Loss path", str(paths)))
    width = max(len(k) for k, _ in lines) + 2
    return "\n".join(f"{k.ljust(width)}{v}".rstrip() for k, v in lines)


def _cmd_check(args: argparse.Namespace) -> int:
    from tf_metal_ops.tools import environment  # noqa: PLC0415

    environment.load_package()  # before `checks`, which imports TensorFlow
    from tf_metal_ops.tools import checks  # noqa: PLC0415
    dtypes = [d for group in (args.dtype or [list(DTYPES)]) for d in group]
    dtypes = list(dict.fromkeys(dtypes))  # keep order, drop repeats
    progress = None if args.json or not sys.stderr.isatty() else _stderr_progress
    result = checks.run_checks(dtypes=dtypes, quick=args.quick, progress=progress)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.format())
    return EXIT_OK if result.passed else EXIT_CHECK_FAILED


def _stderr_progress(done: int, total: int, label: str) -> None:
    end = "\n" if done == total else ""
    sys.stderr.write(f"\r\x1b[K[{done}/{total}] {label}{end}")
    sys.stderr.flush()


def _cmd_demo(args: argparse.Namespace) -> int:
    from tf_metal_ops.tools import demo, environment  # noqa: PLC0415

    if not demo.sklearn_available():
        raise environment.EnvironmentProblem(
            "demo needs scikit-learn, whose bundled copy of the handwritten-digits data it "
            "trains on: run `pip install scikit-learn`.")
    if args.plot is not None and not demo.matplotlib_available():
        raise environment.EnvironmentProblem(
            "--plot needs matplotlib, which is not installed here: run `pip install "
            "matplotlib`, or leave out --plot.")
    environment.load_package()
    demo.run_demo(epochs=args.epochs, seed=args.seed, plot_path=args.plot,
                  jit_compile=True if args.jit_compile else "auto")
    return EXIT_OK


def _cmd_bench(args: argparse.Namespace) -> int:
    from tf_metal_ops.tools import environment  # noqa: PLC0415 - TensorFlow only after parsing
    from tf_metal_ops.tools.bench import suite  # noqa: PLC0415

    environment.load_package()
    return suite.run_and_print(args)


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "info": _cmd_info,
    "check": _cmd_check,
    "demo": _cmd_demo,
    "bench": _cmd_bench,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line `argv` (default `sys.argv[1:]`) and returns the exit code."""
    parser = build_parser()
    # Exits 2 with the usage on a bad flag or value. Unknown flags are collected first and
    # reported by the command's own parser, so the usage shown is the command's.
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _command_parser(parser, args.command).error(
            f"unrecognized arguments: {' '.join(unknown)}")
    # Imported here, not at the top, so that parsing needs nothing but the standard library.
    from tf_metal_ops.tools.environment import EnvironmentProblem  # noqa: PLC0415

    try:
        return _COMMANDS[args.command](args)
    except EnvironmentProblem as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return EXIT_ENVIRONMENT
    except BrokenPipeError:
        # The reader went away (`... | head`): not an error worth a traceback. Point stdout at
        # devnull so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_CHECK_FAILED
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


def console_main() -> None:
    """Entry point of `python -m tf_metal_ops` (the `tf-metal-ops` console script calls `main`,
    whose return value its generated wrapper passes to `sys.exit`)."""
    sys.exit(main())
