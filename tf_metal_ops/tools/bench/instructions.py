"""Instructions a bench case retires, from the CPU's hardware counter where the machine has one.

Load on a shared machine moves timings but not instruction counts, so the bench reports both.
Linux only: perf_event_open(2) counts the user-space instructions of one thread, so a count
opens one counter for each thread of the process (TensorFlow's thread pools exist after the
warm-up), runs the case and sums them. Threads started during the case are not counted. Where
there is no counter (a VM without a virtual PMU, macOS, a perf_event_paranoid setting that
forbids it) `open_counter` says why instead.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
from typing import Callable, List, Optional, Tuple

# linux/perf_event.h
_PERF_TYPE_HARDWARE = 0
_PERF_COUNT_HW_INSTRUCTIONS = 1
_ATTR_SIZE = 112  # PERF_ATTR_SIZE_VER5
_FLAG_DISABLED = 1 << 0
_FLAG_EXCLUDE_KERNEL = 1 << 5
_FLAG_EXCLUDE_HV = 1 << 6
_IOC_ENABLE = 0x2400  # _IO('$', 0)
_IOC_DISABLE = 0x2401  # _IO('$', 1)
_SYSCALL = {"x86_64": 298, "aarch64": 241}  # __NR_perf_event_open


def _attr() -> ctypes.Array:
    raw = bytearray(_ATTR_SIZE)
    struct.pack_into("IIQ", raw, 0, _PERF_TYPE_HARDWARE, _ATTR_SIZE, _PERF_COUNT_HW_INSTRUCTIONS)
    struct.pack_into("Q", raw, 40, _FLAG_DISABLED | _FLAG_EXCLUDE_KERNEL | _FLAG_EXCLUDE_HV)
    return (ctypes.c_char * _ATTR_SIZE).from_buffer_copy(raw)


class InstructionCounter:
    """Counts the user-space instructions all of this process's threads retire in a call."""

    def __init__(self, libc: ctypes.CDLL, syscall_number: int) -> None:
        self._libc = libc
        self._syscall = syscall_number

    def _open(self, tid: int) -> int:
        return self._libc.syscall(self._syscall, _attr(), tid, -1, -1, 0)

    def _open_all(self) -> List[int]:
        fds = []
        for name in os.listdir("/proc/self/task"):
            fd = self._open(int(name))
            if fd >= 0:  # a thread that has exited since the listing
                fds.append(fd)
        return fds

    def count(self, fn: Callable[[], None]) -> int:
        """The instructions retired while `fn` runs, summed over the process's threads."""
        fds = self._open_all()
        try:
            for fd in fds:
                self._libc.ioctl(fd, _IOC_ENABLE, 0)
            fn()
            for fd in fds:
                self._libc.ioctl(fd, _IOC_DISABLE, 0)
            return sum(struct.unpack("Q", os.read(fd, 8))[0] for fd in fds)
        finally:
            for fd in fds:
                os.close(fd)


def open_counter() -> Tuple[Optional[InstructionCounter], str]:
    """(a counter, "") where this machine counts instructions, else (None, why not)."""
    system, machine = platform.system(), platform.machine()
    if system != "Linux":
        return None, f"{system} has no perf_event_open (on macOS, Instruments' CPU Counters)"
    number = _SYSCALL.get(machine)
    if number is None:
        return None, f"perf_event_open's system call number on {machine} is not known here"
    libc = ctypes.CDLL(None, use_errno=True)
    probe = InstructionCounter(libc, number)
    fd = probe._open(0)
    if fd < 0:
        code = ctypes.get_errno()
        why = {
            errno.ENOENT: "the CPU has no instruction counter here (a VM without a virtual PMU)",
            errno.EOPNOTSUPP: "the CPU has no instruction counter here",
            errno.EACCES: "perf_event_paranoid forbids counting",
            errno.EPERM: "perf_event_paranoid forbids counting",
            errno.ENOSYS: "the kernel has no perf events",
        }.get(code, "")
        return None, f"perf_event_open: {os.strerror(code)}" + (f"; {why}" if why else "")
    os.close(fd)
    return probe, ""
