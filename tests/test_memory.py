"""The run's memory figure (workbench/run/memory.py): the driver and every process below it, each
at its PSS plus what it held at its resident peak, read from Linux's /proc."""

import subprocess
import sys
from pathlib import Path

import pytest

from workbench.run.memory import MemoryPeak, descendants, peak_kib, summary_line

pytestmark = pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="not Linux")


def test_the_processes_below_the_driver_are_found_and_counted() -> None:
    # a child that holds 200 MB, and a grandchild below it
    code = (
        "import subprocess, sys, time; block = bytearray(200 * 2**20); "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print(child.pid, flush=True); time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())
        below = descendants(child.pid)
        assert below[0] == child.pid and grandchild in below
        # the bytearray is private and written: all of it is in its PSS
        assert peak_kib(child.pid) >= 200 * 1024
        memory = MemoryPeak(child.pid)
        figures = memory.sample()
        assert figures["memory/processes"] == 2
        assert figures["memory/pss_peak_bytes"] >= 200 * 2**20
    finally:
        for pid in descendants(child.pid)[::-1]:
            subprocess.run(["kill", str(pid)], check=False)
        child.wait()


def test_a_freed_peak_still_counts() -> None:
    # 300 MB written, then freed: the resident high-water mark keeps it
    code = (
        "block = bytearray(300 * 2**20); del block; import time; print(1, flush=True); "
        "time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        child.stdout.readline()
        assert peak_kib(child.pid) >= 300 * 1024
    finally:
        child.kill()
        child.wait()


def test_a_sample_resets_the_high_water_marks_so_the_next_counts_its_own_step() -> None:
    code = (
        "block = bytearray(300 * 2**20); del block; import time; print(1, flush=True); "
        "time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        child.stdout.readline()
        memory = MemoryPeak(child.pid)
        # the start reset the mark: the freed 300 MB is no peak of a step
        assert memory.sample()["memory/pss_peak_bytes"] < 300 * 2**20
    finally:
        child.kill()
        child.wait()


def test_an_ended_process_counts_nothing_and_the_peak_only_grows() -> None:
    assert peak_kib(2**22 + 17) is None
    memory = MemoryPeak()
    first = memory.sample()["memory/pss_peak_bytes"]
    assert memory.sample()["memory/pss_peak_bytes"] >= first > 0


def test_the_summary_line_names_the_peak_and_the_processes() -> None:
    assert summary_line(3.14e9, 9) == (
        "memory     peak PSS 3.1 GB (driver + 8 processes it started, each at its own peak in a "
        "step)"
    )
    assert summary_line(0, 0) == ""
