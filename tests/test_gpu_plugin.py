"""Which plugin provides the GPU, and whether our Metal kernels may run there (gpu_plugin.py).

Each situation a Mac can be in is built here from stand-ins: a site-packages folder with a
`tensorflow-plugins` folder, the distributions' metadata that list its files (the
`*.dist-info/RECORD` pip writes), and the loader's answer to "is this library loaded". The
decision and its reason are checked for each, and so is what follows from it: the GPU kernels are
registered only where Apple's plugin alone provides the GPU (so no other plugin's stream ever
reaches a kernel of ours), `loss_path` composes the loss on any other GPU and says why, and
`info` and `check` name the plugin.
"""

from __future__ import annotations

import ctypes
import shutil
import sys
import sysconfig
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, Iterable, Optional

import pytest
import tensorflow as tf

import tf_metal_ops
from tf_metal_ops import _native, gpu_plugin, loss_path

APPLE_LIB = "libmetal_plugin.dylib"
COMMUNITY_LIB = "libmetal_pluggable_device.dylib"


def _install(site: Path, distribution: str, version: str, files: Iterable[str]) -> None:
    """Writes a plugin distribution into `site` as pip would: the files, and a dist-info whose
    RECORD lists them."""
    files = list(files)
    for name in files:
        path = site / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"stand-in for a Mach-O plugin")
    info = site / f"{distribution.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\n"
                                   f"Version: {version}\n")
    record = [f"{name},sha256=stand-in,28" for name in files]
    record += [f"{info.name}/METADATA,,", f"{info.name}/RECORD,,"]
    (info / "RECORD").write_text("\n".join(record) + "\n")


def _stray(site: Path, name: str) -> None:
    """A plugin library no installed distribution lists (copied by hand, or left behind)."""
    path = site / gpu_plugin.PLUGIN_FOLDER / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"stand-in")


def _decide(site: Path, loaded: Optional[Iterable[str]] = None, system: str = "Darwin",
            env_path: str = "") -> gpu_plugin.GpuPlugin:
    """The decision for `site`, with the libraries named in `loaded` (all if None) loaded."""
    names = None if loaded is None else set(loaded)
    folder = site / gpu_plugin.PLUGIN_FOLDER
    return gpu_plugin.find(folders=[str(folder)] if folder.is_dir() else [], env_path=env_path,
                           system=system,
                           loaded=lambda p: names is None or Path(p).name in names,
                           search_path=[str(site)])


@pytest.fixture
def site(tmp_path: Path) -> Path:
    path = tmp_path / "site-packages"
    path.mkdir()
    return path


def test_no_plugin(site):
    decision = _decide(site)
    assert decision.name == "none" and not decision.metal_kernels
    assert "no TensorFlow GPU plugin is installed" in decision.reason


def test_apples_plugin_gets_our_kernels(site):
    _install(site, "tensorflow-metal", "1.2.0", [f"tensorflow-plugins/{APPLE_LIB}"])
    decision = _decide(site)
    assert decision.name == "tensorflow-metal" and decision.metal_kernels
    assert "Apple's tensorflow-metal 1.2.0" in decision.reason
    assert [Path(lib.path).name for lib in decision.libraries] == [APPLE_LIB]
    assert decision.libraries[0].distribution == ("tensorflow-metal", "1.2.0")


def test_community_plugin_gets_the_composed_loss(site):
    _install(site, "tensorflow-metal-plugin", "0.3.1", [f"tensorflow-plugins/{COMMUNITY_LIB}"])
    decision = _decide(site)
    assert decision.name == "tensorflow-metal-plugin" and not decision.metal_kernels
    assert "tensorflow-metal-plugin 0.3.1" in decision.reason
    assert "not Apple's TF_MetalStream" in decision.reason


def test_community_plugin_under_apples_file_name_is_not_apples(site):
    # The owner decides, not the file name: a plugin that ships a file named as Apple's is not
    # Apple's.
    _install(site, "tensorflow-metal-plugin", "0.3.1", [f"tensorflow-plugins/{APPLE_LIB}"])
    decision = _decide(site)
    assert decision.name == "tensorflow-metal-plugin" and not decision.metal_kernels


def test_unknown_plugin(site):
    _install(site, "acme-gpu-plugin", "2.0", ["tensorflow-plugins/libacme.dylib"])
    decision = _decide(site)
    assert decision.name == "unknown" and not decision.metal_kernels
    assert "libacme.dylib (acme-gpu-plugin 2.0)" in decision.reason


def test_library_no_distribution_lists_is_unknown(site):
    _stray(site, APPLE_LIB)  # Apple's name, but pip installed no such file
    decision = _decide(site)
    assert decision.name == "unknown" and not decision.metal_kernels
    assert "no installed distribution" in decision.reason


def test_stale_install_that_did_not_load(site):
    # tensorflow-metal 1.2.0 left in place under a TensorFlow it does not load into: no GPU.
    _install(site, "tensorflow-metal", "1.2.0", [f"tensorflow-plugins/{APPLE_LIB}"])
    decision = _decide(site, loaded=[])
    assert decision.name == "none" and not decision.metal_kernels
    assert "not loaded" in decision.reason and "tensorflow-metal 1.2.0" in decision.reason


def test_stale_apple_install_beside_the_loaded_community_plugin(site):
    _install(site, "tensorflow-metal", "1.2.0", [f"tensorflow-plugins/{APPLE_LIB}"])
    _install(site, "tensorflow-metal-plugin", "0.3.1", [f"tensorflow-plugins/{COMMUNITY_LIB}"])
    decision = _decide(site, loaded=[COMMUNITY_LIB])
    assert decision.name == "tensorflow-metal-plugin" and not decision.metal_kernels


def test_two_loaded_plugins_keep_our_kernels_off(site):
    _install(site, "tensorflow-metal", "1.2.0", [f"tensorflow-plugins/{APPLE_LIB}"])
    _install(site, "tensorflow-metal-plugin", "0.3.1", [f"tensorflow-plugins/{COMMUNITY_LIB}"])
    decision = _decide(site)
    assert decision.name == "several" and not decision.metal_kernels
    assert APPLE_LIB in decision.reason and COMMUNITY_LIB in decision.reason


def test_plugin_named_by_the_environment_variable(site, tmp_path):
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "libother.dylib").write_bytes(b"stand-in")
    _install(site, "tensorflow-metal", "1.2.0", [f"tensorflow-plugins/{APPLE_LIB}"])
    decision = _decide(site, env_path=str(other / "libother.dylib"))
    assert decision.name == "several" and not decision.metal_kernels


@pytest.mark.parametrize("name, system, taken", [
    ("libmetal_plugin.dylib", "Darwin", True),
    ("libmetal_plugin.dylib", "Linux", False),
    ("libplugin.so", "Linux", True),
    ("libplugin.so.2", "Linux", True),
    ("libplugin.so.x", "Linux", False),
    ("README.txt", "Darwin", False),
    ("libplugin.so", "Darwin", False),
])
def test_files_tensorflow_loads_from_a_plugin_folder(name, system, taken):
    assert gpu_plugin.is_shared_library(name, system) is taken


def test_is_loaded_asks_the_loader_without_loading(tmp_path):
    # A copy of one of Python's own extension modules: a real shared library at a new path,
    # not loaded until ctypes loads it (loading runs no Python initialization).
    dynload = Path(sysconfig.get_config_var("DESTSHARED") or "")
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    candidates = sorted(dynload.glob(f"*{suffix}")) if dynload.is_dir() else []
    if not candidates:
        pytest.skip(f"this Python ({sys.executable}) ships no extension modules as files")
    copy = tmp_path / f"libstandin{Path(candidates[0]).suffix}"
    shutil.copy(candidates[0], copy)
    assert gpu_plugin.is_loaded(str(copy)) is False
    assert gpu_plugin.is_loaded(str(copy)) is False  # the query itself loaded nothing
    handle = ctypes.CDLL(str(copy))
    assert handle is not None and gpu_plugin.is_loaded(str(copy)) is True
    assert gpu_plugin.is_loaded(str(tmp_path / "missing.so")) is False


def test_this_process_decision_matches_a_fresh_search():
    assert gpu_plugin.gpu_plugin() == gpu_plugin.find()
    # The registry holds a GPU kernel of ours exactly when the gate let a Metal build register.
    expected = gpu_plugin.gpu_plugin().metal_kernels and tf_metal_ops.metal_available()
    assert ("GPU" in loss_path.kernel_device_types()) is expected


class _RecordingRuntime:
    """A stand-in for the native runtime module of a Metal build: records registration."""

    def __init__(self, metal: bool):
        self.metal = metal
        self.registrations = 0

    def build_info(self) -> Dict[str, bool]:
        return {"metal_compiled_in": self.metal}

    def register_metal_kernels(self) -> bool:
        self.registrations += 1
        return True


@pytest.mark.parametrize("installed, registered", [
    ([], False),
    ([("tensorflow-metal", "1.2.0", APPLE_LIB)], True),
    ([("tensorflow-metal-plugin", "0.3.1", COMMUNITY_LIB)], False),
    ([("acme-gpu-plugin", "2.0", "libacme.dylib")], False),
    ([("tensorflow-metal", "1.2.0", APPLE_LIB),
      ("tensorflow-metal-plugin", "0.3.1", COMMUNITY_LIB)], False),
])
def test_gpu_kernels_registered_only_for_apples_plugin(site, monkeypatch, installed, registered):
    for distribution, version, library in installed:
        _install(site, distribution, version, [f"tensorflow-plugins/{library}"])
    decision = _decide(site)
    monkeypatch.setattr(gpu_plugin, "gpu_plugin", lambda: decision)
    metal_build = _RecordingRuntime(metal=True)
    assert _native.register_metal_kernels_if_apple(metal_build) is registered
    assert metal_build.registrations == int(registered)
    linux_build = _RecordingRuntime(metal=False)  # no Metal kernels to register, whatever the plugin
    assert _native.register_metal_kernels_if_apple(linux_build) is False
    assert linux_build.registrations == 0


def test_this_build_registers_no_gpu_kernel_without_apples_plugin():
    # The real runtime: a Linux build has no Metal kernels, and asking registers nothing.
    if tf_metal_ops.metal_available():
        pytest.skip("a Metal build: its registration is the gate's (tested above)")
    assert _native.runtime().register_metal_kernels() is False
    for op in _native.LOSS_OPS:
        assert {k["device_type"] for k in _native.registered_kernels(op)} == {"CPU"}


@pytest.mark.parametrize("installed, name", [
    ([("tensorflow-metal-plugin", "0.3.1", COMMUNITY_LIB)], "tensorflow-metal-plugin"),
    ([("acme-gpu-plugin", "2.0", "libacme.dylib")], "unknown"),
])
def test_loss_on_another_plugins_gpu_is_composed_and_says_why(site, monkeypatch, installed,
                                                              name):
    for distribution, version, library in installed:
        _install(site, distribution, version, [f"tensorflow-plugins/{library}"])
    decision = _decide(site)
    assert decision.name == name
    monkeypatch.setattr(gpu_plugin, "gpu_plugin", lambda: decision)
    monkeypatch.setattr(loss_path, "visible_device_types", lambda: ("CPU", "GPU"))
    # What the registry holds on a Mac where the gate refused: the CPU kernels only.
    monkeypatch.setattr(loss_path, "kernel_device_types", lambda: ("CPU",))
    logits = tf.zeros([2, 3])
    with tf.device("/GPU:0"):
        path, reason = loss_path.choose(logits)
    assert path == loss_path.COMPOSED_DEVICE
    assert "GPU has no kernel of ours" in reason and decision.reason in reason
    info = tf_metal_ops.loss_path_info()
    assert info["gpu_plugin"]["name"] == name and info["gpu_plugin"]["metal_kernels"] is False
    assert decision.reason in loss_path.describe_machine(("CPU", "GPU"))


def test_info_and_check_name_the_plugin(site, monkeypatch):
    from tf_metal_ops.tools import checks, cli, environment

    _install(site, "tensorflow-metal-plugin", "0.3.1", [f"tensorflow-plugins/{COMMUNITY_LIB}"])
    decision = _decide(site)
    monkeypatch.setattr(gpu_plugin, "gpu_plugin", lambda: decision)
    info = environment.describe()
    assert info["loss_path"]["gpu_plugin"]["name"] == "tensorflow-metal-plugin"
    text = cli.format_info(info)
    assert "GPU plugin" in text and "tensorflow-metal-plugin 0.3.1" in text
    results = checks.CheckResults(results=[], dtypes=["float32"], quick=True,
                                  devices=["CPU:0", "GPU:0"], gpu_found=True, versions={},
                                  gpu_plugin=decision.as_dict())
    notes = " ".join(results.notes())
    assert "tensorflow-metal-plugin 0.3.1" in notes and "not our Metal kernels" in notes
    assert results.to_dict()["gpu_plugin"]["name"] == "tensorflow-metal-plugin"


def test_decision_is_serializable():
    import json

    decision = gpu_plugin.decide([gpu_plugin.PluginLibrary("/x/libmetal_plugin.dylib", True,
                                                           ("tensorflow-metal", "1.2.0"))])
    assert json.loads(json.dumps(decision.as_dict()))["metal_kernels"] is True
    assert SimpleNamespace(**decision.as_dict()).libraries == [
        "libmetal_plugin.dylib (tensorflow-metal 1.2.0)"]
