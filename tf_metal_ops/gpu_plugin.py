"""Which PluggableDevice provides TensorFlow's GPU, and whether our Metal kernels may run on it.

Our Metal kernels talk to the GPU through Apple's TF_MetalStream: the `SP_Stream` handle that
`TF_GetStream` returns is, under Apple's `tensorflow-metal`, an Objective-C object answering
`queue`, `currentCommandBuffer`, `commit` and `commitAndWait`. Another Metal PluggableDevice
(the community `tensorflow-metal-plugin` for TensorFlow 2.20, or any future one) registers the
same `GPU` device type with a stream of its own kind: a C++ struct, to which an Objective-C
message (even `respondsToSelector:`) is undefined behaviour, and in practice a crash. Nothing
the kernel can do safely tells the two handles apart, so the decision is made here, before any
graph is built, from what TensorFlow loaded: the shared libraries of each `tensorflow-plugins`
folder TensorFlow scans (the folders `tensorflow/__init__.py` scans, plus
`TF_PLUGGABLE_DEVICE_LIBRARY_PATH`), whether each is loaded in this process, and which installed
distribution's RECORD lists it. Only when every loaded plugin library belongs to Apple's
`tensorflow-metal` are our GPU kernels registered (`_native.load`); otherwise the GPU keeps no
kernel of ours and `loss_path` composes the loss there from TensorFlow ops, as on a CUDA GPU.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import os
import platform
import site
import sys
import sysconfig
from pathlib import Path
from typing import Callable, Iterable, List, NamedTuple, Optional, Sequence, Tuple

APPLE_DISTRIBUTION = "tensorflow-metal"
# Plugins known by name, for the reason's wording; anything else is "unknown".
KNOWN_OTHER_DISTRIBUTIONS = {
    "tensorflow-metal-plugin": "a community Metal PluggableDevice whose stream is not Apple's "
                               "TF_MetalStream",
}
PLUGIN_FOLDER = "tensorflow-plugins"
PLUGIN_PATH_ENV = "TF_PLUGGABLE_DEVICE_LIBRARY_PATH"


class PluginLibrary(NamedTuple):
    """One shared library TensorFlow loads as a plugin."""

    path: str
    loaded: bool  # present in this process (it failed to load, or the install is stale, if not)
    distribution: Optional[Tuple[str, str]]  # (name, version) whose RECORD lists it, or None

    def describe(self) -> str:
        owner = (f"{self.distribution[0]} {self.distribution[1]}" if self.distribution
                 else "no installed distribution")
        return f"{Path(self.path).name} ({owner}{'' if self.loaded else ', not loaded'})"


class GpuPlugin(NamedTuple):
    """The decision: `name` of the GPU's provider, whether our Metal kernels may be registered
    for it, and the reason in one sentence."""

    name: str  # "none", "tensorflow-metal", "tensorflow-metal-plugin", "unknown", "several"
    metal_kernels: bool
    reason: str
    libraries: Tuple[PluginLibrary, ...] = ()

    def as_dict(self) -> dict:
        return {"name": self.name, "metal_kernels": self.metal_kernels, "reason": self.reason,
                "libraries": [lib.describe() for lib in self.libraries]}


def plugin_folders() -> List[str]:
    """The folders TensorFlow's import scans for plugins: `tensorflow-plugins` under every
    site-packages folder it knows (user site, sys.path, site.getsitepackages(), each sysconfig
    scheme's purelib and platlib), as `tensorflow/__init__.py` lists them."""
    bases = []
    if site.ENABLE_USER_SITE and site.USER_SITE is not None:
        bases.append(site.USER_SITE)
    bases += [p for p in sys.path if "site-packages" in p]
    if hasattr(site, "getsitepackages"):
        bases += site.getsitepackages()
    for scheme in sysconfig.get_scheme_names():
        for name in ("purelib", "platlib"):
            try:
                bases.append(sysconfig.get_path(name, scheme))
            except KeyError:  # a scheme without that path
                continue
    seen, folders = set(), []
    for base in bases:
        folder = os.path.realpath(os.path.join(base, PLUGIN_FOLDER))
        if folder not in seen and os.path.isdir(folder):
            seen.add(folder)
            folders.append(folder)
    return folders


def is_shared_library(filename: str, system: Optional[str] = None) -> bool:
    """Whether TensorFlow's loader takes this file from a plugin folder (by its name alone, as
    `tensorflow.python.framework.load_library` decides): `.so` / `.so.N` on Linux, `.dylib` on
    macOS."""
    system = system or platform.system()
    if system == "Linux":
        index = filename.rfind(".so.")
        return filename.endswith(".so") or (index != -1 and filename[index + 4:index + 5].isdigit())
    if system == "Darwin":
        return filename.endswith(".dylib")
    return False


def plugin_library_paths(folders: Iterable[str], env_path: str = "",
                         system: Optional[str] = None) -> List[str]:
    """The plugin libraries in `folders` and in `env_path` (a file or a folder, as
    TF_PLUGGABLE_DEVICE_LIBRARY_PATH), absolute and real, each once."""
    paths: List[str] = []
    entries = list(folders) + ([env_path] if env_path else [])
    for entry in entries:
        if os.path.isdir(entry):
            names = sorted(n for n in os.listdir(entry) if is_shared_library(n, system))
            candidates = [os.path.join(entry, n) for n in names]
        elif os.path.isfile(entry):
            candidates = [entry]
        else:
            continue
        for path in candidates:
            real = os.path.realpath(path)
            if real not in paths:
                paths.append(real)
    return paths


def is_loaded(path: str) -> bool:
    """Whether the shared library at `path` is already loaded in this process. RTLD_NOLOAD asks
    the dynamic loader without loading anything (Linux and macOS alike)."""
    mode = getattr(os, "RTLD_NOLOAD", None)
    if mode is None:  # pragma: no cover - a platform without RTLD_NOLOAD (Windows)
        return False
    try:
        ctypes.CDLL(path, mode=mode | getattr(os, "RTLD_LAZY", 1))
    except OSError:
        return False
    return True


def owning_distributions(paths: Sequence[str], search_path: Optional[Sequence[str]] = None
                         ) -> dict:
    """{real path: (distribution name, version)} for each path some installed distribution's
    RECORD lists. Reads only the RECORDs that mention a plugin folder."""
    wanted = {os.path.realpath(p) for p in paths}
    owners: dict = {}
    if not wanted:
        return owners
    found = (importlib.metadata.distributions() if search_path is None
             else importlib.metadata.distributions(path=list(search_path)))
    for dist in found:
        record = dist.read_text("RECORD") or ""
        if PLUGIN_FOLDER not in record:
            continue
        for file in dist.files or ():
            if PLUGIN_FOLDER not in file.parts:
                continue
            real = os.path.realpath(str(dist.locate_file(file)))
            if real in wanted and real not in owners:
                name = dist.metadata["Name"] or "unknown"
                owners[real] = (name.lower().replace("_", "-"), dist.version)
    return owners


def decide(libraries: Sequence[PluginLibrary]) -> GpuPlugin:
    """The decision from the plugin libraries found (see the module docstring)."""
    libraries = tuple(libraries)
    loaded = [lib for lib in libraries if lib.loaded]
    if not libraries:
        return GpuPlugin("none", False, ("no TensorFlow GPU plugin is installed (a CUDA GPU is TensorFlow's "
                                         "own and has no kernel of ours)"), libraries)
    if not loaded:
        return GpuPlugin("none", False,
                         "no GPU plugin is loaded (installed but not loaded by this TensorFlow: "
                         + ", ".join(lib.describe() for lib in libraries) + ")", libraries)
    owners = {lib.distribution[0] if lib.distribution else None for lib in loaded}
    listed = ", ".join(lib.describe() for lib in loaded)
    if owners == {APPLE_DISTRIBUTION}:
        version = next(lib.distribution[1] for lib in loaded if lib.distribution)
        return GpuPlugin(APPLE_DISTRIBUTION, True,
                         f"Apple's tensorflow-metal {version} provides the GPU (its "
                         f"TF_MetalStream): our Metal kernels run there", libraries)
    if len(owners) > 1:
        return GpuPlugin("several", False,
                         f"several GPU plugins are loaded ({listed}): the GPU's stream may not "
                         f"be Apple's TF_MetalStream, so our Metal kernels stay off", libraries)
    owner = owners.pop()
    if owner in KNOWN_OTHER_DISTRIBUTIONS:
        return GpuPlugin(owner, False,
                         f"{listed} provides the GPU, {KNOWN_OTHER_DISTRIBUTIONS[owner]}: our "
                         f"Metal kernels stay off and the loss is composed of TensorFlow ops "
                         f"there", libraries)
    return GpuPlugin("unknown", False,
                     f"an unknown GPU plugin is loaded ({listed}): only Apple's tensorflow-metal "
                     f"gets our Metal kernels", libraries)


def find(folders: Optional[Sequence[str]] = None, env_path: Optional[str] = None,
         system: Optional[str] = None, loaded: Callable[[str], bool] = is_loaded,
         search_path: Optional[Sequence[str]] = None) -> GpuPlugin:
    """Finds the plugin libraries and decides. The arguments replace the process's own folders,
    environment, platform, loader query and distribution search path (for tests)."""
    folders = plugin_folders() if folders is None else folders
    env_path = os.environ.get(PLUGIN_PATH_ENV, "") if env_path is None else env_path
    paths = plugin_library_paths(folders, env_path, system)
    owners = owning_distributions(paths, search_path)
    return decide([PluginLibrary(p, loaded(p), owners.get(p)) for p in paths])


@functools.lru_cache(maxsize=None)
def gpu_plugin() -> GpuPlugin:
    """This process's decision, made once (after TensorFlow's import loaded its plugins)."""
    return find()
