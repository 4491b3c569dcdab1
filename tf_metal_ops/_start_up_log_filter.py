"""Copies standard input to standard output less TensorFlow's start-up log lines.

The command-line tool runs this file as a process of its own while the package loads TensorFlow
(tf_metal_ops/_command_line.py says why the lines are held back): a filter that outlives a crash
of the tool, so a fatal line written just before the process dies still reaches the user. It
imports nothing of the package, which would load TensorFlow.
"""

from __future__ import annotations

import re
import signal
import sys

# Abseil's banner, and its line prefix "<severity><MMDD> <hh:mm:ss.micros> <thread> <file:line>] "
# at severities I, W and E (a fatal line, F, stays). Before its log is initialized, Abseil
# writes the date as 0000 and the whole Unix time as seconds: "I0000 00:00:1796456850.464859".
START_UP_LOG_LINE = re.compile(
    rb"WARNING: All log messages before absl::InitializeLog\(\)"
    rb"|[IWE]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [^ \]]+:\d+\] ")


def is_start_up_log_line(line: bytes) -> bool:
    return START_UP_LOG_LINE.match(line) is not None


def main() -> None:
    # Ctrl-C reaches the whole process group: the filter keeps copying until the tool's end of
    # the pipe closes, so nothing the tool wrote before is lost.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    for line in iter(source.readline, b""):
        if not is_start_up_log_line(line):
            sink.write(line)
            sink.flush()


if __name__ == "__main__":
    main()
