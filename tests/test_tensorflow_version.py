"""The TensorFlow version check that `import`ing the native library runs first: a refusal below
the supported minimum, a warning past the newest version that CI tests, silence in between."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from tf_metal_ops import _native

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("version", ["2.16.0", "2.16.2", "2.18.1", "2.21.0", "2.22.0rc0",
                                     "2.22.0-rc0", "2.22.0", "2.22.3"])
def test_supported_versions_load_without_a_warning(version):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _native.check_tensorflow_version(version)


@pytest.mark.parametrize("version", ["2.23.0-rc0", "2.23.0", "3.0.0"])
def test_a_version_past_the_tested_range_warns_naming_both(version):
    with pytest.warns(RuntimeWarning, match=rf"up to 2\.22; TensorFlow {re.escape(version)} "
                                            r"is newer and untested"):
        _native.check_tensorflow_version(version)


@pytest.mark.parametrize("version", ["2.15.1", "2.9.0", "1.15.0"])
def test_a_version_before_keras_3_is_refused_naming_the_minimum(version):
    with pytest.raises(_native.NativeLibraryError, match=rf"TensorFlow >= 2\.16.*{version}"):
        _native.check_tensorflow_version(version)


def _versions(command_line: str) -> list:
    return [tuple(int(part) for part in v.split(".")) for v in command_line.split()]


def test_the_newest_tested_version_is_the_newest_that_ci_runs():
    """The warning's bound, tests/cross_version.sh's default list and CI's call of it name the
    same newest version, so raising one alone fails here."""
    script = (ROOT / "tests" / "cross_version.sh").read_text()
    default = re.search(r"VERSIONS=\(([\d. ]+)\)", script)
    ci = re.search(r"cross_version\.sh((?: \d+\.\d+)+)", (ROOT / ".ci" / "run").read_text())
    assert default and ci, "the version lists of tests/cross_version.sh or .ci/run moved"
    assert max(_versions(default.group(1))) == _native.NEWEST_TESTED_TENSORFLOW
    assert max(_versions(ci.group(1))) == _native.NEWEST_TESTED_TENSORFLOW
