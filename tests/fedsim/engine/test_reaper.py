"""The reaper ends a killed driver's Ray processes (and only those), without needing Ray."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedsim.engine import reaper

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reaper reads /proc")

ROOT = Path(__file__).resolve().parents[3]

#: A stand-in driver: one "Ray" child (named like a Ray worker) and one unrelated child, then its reaper.
DRIVER = f"""
import subprocess, sys, time
sys.path.insert(0, {str(ROOT)!r})
from fedsim.engine import reaper
ray = subprocess.Popen(["bash", "-c", "exec -a ray::FakeAgent sleep 300"])
other = subprocess.Popen(["sleep", "300"])
time.sleep(0.3)
reaper.ensure_started()
print(ray.pid, other.pid, flush=True)
time.sleep(300)
"""


def _alive(pid: int) -> bool:
    stat = reaper._stat(pid)
    return stat is not None and not Path(f"/proc/{pid}/status").read_text().count("State:\tZ")


def test_ray_descendants_finds_ray_processes_below_a_root() -> None:
    child = subprocess.Popen(["bash", "-c", "exec -a ray::FakeWorker sleep 30"])
    plain = subprocess.Popen(["sleep", "30"])
    try:
        time.sleep(0.3)
        found = reaper.ray_descendants(os.getpid())
        assert child.pid in found and plain.pid not in found
        assert plain.pid in reaper.descendants(os.getpid())
    finally:
        child.kill(), plain.kill(), child.wait(), plain.wait()


def test_kill_9_of_the_driver_takes_its_ray_processes_with_it() -> None:
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True)
    ray_pid = other_pid = None
    try:
        ray_pid, other_pid = map(int, driver.stdout.readline().split())
        time.sleep(reaper.PERIOD_S * 2.5)  # the reaper has recorded them
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        deadline = time.monotonic() + 15
        while _alive(ray_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(ray_pid)  # the orphaned Ray process was reaped
        assert _alive(other_pid)  # a non-Ray child is none of the reaper's business
    finally:
        for pid in (ray_pid, other_pid):
            if pid is not None and _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if driver.poll() is None:
            driver.kill()
