"""Runs Python code in a child process, against the same tf_metal_ops the tests import.

Settings the native library reads once per process (environment switches, the instruction-set
choice) can only be tested in a process of their own. The child gets this package's parent
directory first on PYTHONPATH, runs from a temporary directory (so a source checkout in the
working directory cannot shadow the installed package) and must exit with status 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterable, Optional

import tf_metal_ops

PACKAGE_PARENT = str(Path(tf_metal_ops.__file__).resolve().parent.parent)


def run_python(script: str, *args: str, env: Optional[Dict[str, str]] = None,
               unset: Iterable[str] = (), timeout: int = 600,
               must_succeed: bool = True) -> subprocess.CompletedProcess:
    """Runs `script` with `args` in a child Python whose environment is this one without the
    variables in `unset`, plus `env`; fails with the child's stderr unless it exits with 0
    (or `must_succeed` is False: then the caller checks)."""
    environ = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    for name in unset:
        environ.pop(name, None)
    environ.update(env or {})
    environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (PACKAGE_PARENT, environ.get("PYTHONPATH")) if p)
    completed = subprocess.run([sys.executable, "-c", script, *args], capture_output=True,
                               text=True, env=environ, timeout=timeout,
                               cwd=tempfile.gettempdir(), check=False)
    assert completed.returncode == 0 or not must_succeed, completed.stderr[-3000:]
    return completed


def last_json_line(completed: subprocess.CompletedProcess) -> Any:
    """The JSON value the child printed last."""
    return json.loads(completed.stdout.strip().splitlines()[-1])
