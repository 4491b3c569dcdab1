"""setup.py's object cache: an object is reused exactly when everything that decides its bytes
is the same (the compiler, the flags, every header's content), wherever the headers live.

The cache is what lets the README's second install and CI's wheel skip the row kernels'
minutes of compiling, so a wrong hit would ship an object built from other sources or flags.
These tests compile a two-file program with the tests' C++ compiler through ObjectCache, as
setup.py's build_ext does, and check hits and misses by the objects' bytes.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "msl_host"))
import msl_build  # noqa: E402  (the tests' one choice of C++ compiler: $CXX, else g++)


class Compiler:
    """The parts of distutils' Unix compiler that ObjectCache uses, compiling for real."""

    compiler_type = "unix"

    def __init__(self):
        self.compiler_so = msl_build.cxx()
        self.compiler_so_cxx = msl_build.cxx()
        self.runs = 0

    def detect_language(self, source):
        return "c++"

    def _compile(self, obj, src, ext, cc_args, extra_postargs, pp_opts):
        self.runs += 1
        subprocess.run([*self.compiler_so_cxx, *cc_args, src, "-o", obj, *extra_postargs],
                       check=True)


@pytest.fixture
def project(tmp_path):
    (tmp_path / "inc").mkdir()
    (tmp_path / "inc" / "value.h").write_text("inline int Value() { return 41; }\n")
    source = tmp_path / "main.cc"
    source.write_text('#include "value.h"\nint Answer() { return Value() + 1; }\n')
    return tmp_path


class Build:
    """One cache directory, compiles into fresh object paths, counting compiler runs."""

    def __init__(self, setup_py, root: Path, max_bytes=None):
        self.setup_py = setup_py
        self.root = root
        self.cache_dir = root / "cache"
        self.max_bytes = setup_py.OBJECT_CACHE_MAX_BYTES if max_bytes is None else max_bytes
        self.count = 0

    def compile(self, include_dir: Path, flags=("-O2",)) -> tuple:
        """(the object's bytes, whether the compiler ran)."""
        compiler = Compiler()
        cache = self.setup_py.ObjectCache(self.cache_dir, self.max_bytes)
        cache.install(compiler)
        self.count += 1
        obj = self.root / "out" / f"{self.count}" / "main.o"
        obj.parent.mkdir(parents=True)  # as distutils does before compiling
        cc_args = ["-I", str(include_dir), "-c"]
        compiler._compile(str(obj), str(self.root / "main.cc"), ".cc", cc_args, list(flags),
                          ["-I", str(include_dir)])
        cache.prune()
        assert cache.reused + cache.compiled == 1
        assert compiler.runs == cache.compiled
        return obj.read_bytes(), compiler.runs == 1


def test_same_sources_and_flags_reuse_the_object(setup_py, project):
    build = Build(setup_py, project)
    first, ran = build.compile(project / "inc")
    assert ran
    again, ran = build.compile(project / "inc")
    assert not ran
    assert again == first


def test_headers_elsewhere_with_the_same_content_reuse_the_object(setup_py, project):
    # pip's isolated build environment puts TensorFlow's headers in a new directory each time.
    build = Build(setup_py, project)
    build.compile(project / "inc")
    moved = project / "elsewhere"
    moved.mkdir()
    (moved / "value.h").write_text((project / "inc" / "value.h").read_text())
    _, ran = build.compile(moved)
    assert not ran


def test_a_changed_header_compiles_again(setup_py, project):
    build = Build(setup_py, project)
    first, _ = build.compile(project / "inc")
    (project / "inc" / "value.h").write_text("inline int Value() { return 1; }\n")
    changed, ran = build.compile(project / "inc")
    assert ran
    assert changed != first


def test_a_changed_flag_compiles_again(setup_py, project):
    build = Build(setup_py, project)
    build.compile(project / "inc", flags=("-O2",))
    _, ran = build.compile(project / "inc", flags=("-O0",))
    assert ran
    _, ran = build.compile(project / "inc", flags=("-O2", "-DEXTRA=1"))
    assert ran


def test_a_source_the_compiler_rejects_fails_as_without_the_cache(setup_py, project):
    (project / "main.cc").write_text("int Answer( {\n")
    with pytest.raises(subprocess.CalledProcessError):
        Build(setup_py, project).compile(project / "inc")
    assert not (project / "cache").exists() or not list((project / "cache").glob("*.o"))


def test_a_source_that_does_not_preprocess_compiles_uncached(setup_py, project):
    # A missing header: no key, so the compiler runs and reports the error itself.
    (project / "main.cc").write_text('#include "missing.h"\nint Answer() { return 1; }\n')
    with pytest.raises(subprocess.CalledProcessError):
        Build(setup_py, project).compile(project / "inc")
    assert not (project / "cache").exists() or not list((project / "cache").glob("*.o"))


def test_an_object_pruned_by_another_build_is_compiled_again(setup_py, project):
    build = Build(setup_py, project)
    build.compile(project / "inc")
    for cached in build.cache_dir.glob("*.o"):
        cached.unlink()
    _, ran = build.compile(project / "inc")
    assert ran


def test_debug_information_keeps_line_markers_in_the_key(setup_py):
    assert not setup_py.with_debug_info(["g++", "-O3", "-g0"])
    assert not setup_py.with_debug_info(["g++", "-g", "-O3", "-g0"])  # pybind11 adds -g0 last
    assert setup_py.with_debug_info(["g++", "-g0", "-g"])
    assert setup_py.with_debug_info(["g++", "-g2"])
    assert not setup_py.with_debug_info(["g++", "-gsplit-dwarf"])


def test_the_key_uses_the_driver_distutils_runs_for_the_language(setup_py):
    # distutils' Unix compiler runs compiler_so_cxx for C++ sources where it has one.
    from setuptools._distutils.ccompiler import new_compiler

    compiler = new_compiler()
    compiler.set_executables(compiler_so=["cc-for-c", "-DC"])
    if not hasattr(compiler, "compiler_so_cxx"):
        pytest.skip("this setuptools has no C++ driver of its own: compiler_so compiles both")
    compiler.set_executables(compiler_so_cxx=["cxx-for-cxx", "-DCXX"])
    assert setup_py.compiler_driver(compiler, "a.cc") == ("cxx-for-cxx", "-DCXX")
    assert setup_py.compiler_driver(compiler, "a.c") == ("cc-for-c", "-DC")


def test_prune_keeps_the_most_recently_used_objects(setup_py, project):
    build = Build(setup_py, project)
    build.compile(project / "inc", flags=("-O0",))
    build.compile(project / "inc", flags=("-O1",))
    objects = sorted(build.cache_dir.glob("*.o"), key=lambda p: p.stat().st_mtime)
    assert len(objects) == 2
    oldest, newest = objects
    # An older use of the -O0 object, then a cache that holds only one object.
    os.utime(oldest, (1, 1))
    build.max_bytes = newest.stat().st_size
    build.compile(project / "inc", flags=("-O1",))  # a hit; pruning drops the other
    assert [p.name for p in build.cache_dir.glob("*.o")] == [newest.name]
