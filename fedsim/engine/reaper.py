"""A watcher that ends the processes a driver started once the driver is gone, even after ``kill -9``.

Ray's head processes (GCS, raylet) die with the driver that started them (Linux parent-death
signal), but the raylet's own children, the dashboard and runtime-env agents, outlive a killed
driver for good (seen with Ray 2.55).  :func:`start` launches this file as a separate process (in
its own session, standard library only, ``python -S``) that every ``PERIOD_S`` seconds records the
driver's Ray descendants (a ``ray::`` worker or a program of the ray package), and when the pipe from the driver closes (the driver exited or was killed)
kills those still alive; a pid counts only with the start time it was recorded with, so a reused
pid is never hit.  Linux only (it reads ``/proc``); elsewhere :func:`start` does nothing.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

PERIOD_S = 1.0


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, start time) of ``pid`` from /proc, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()  # after "pid (comm) "
    return int(fields[1]), fields[19]


def descendants(root: int) -> dict[int, str]:
    """Every live descendant of ``root``: pid -> start time."""
    stats = {int(p): s for p in os.listdir("/proc") if p.isdigit() and (s := _stat(int(p))) is not None}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    found: dict[int, str] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid not in found:
            found[pid] = stats[pid][1]
            todo += children.get(pid, [])
    return found


def _is_ray(pid: int) -> bool:
    """A Ray process: a worker (``ray::...``) or a program from the ray package (gcs, raylet, agents)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return False
    return cmd.startswith("ray::") or "/ray/" in cmd


def ray_descendants(root: int) -> dict[int, str]:
    """The live Ray processes below ``root``: pid -> start time."""
    return {p: s for p, s in descendants(root).items() if p != os.getpid() and _is_ray(p)}


def _alive(recorded: dict[int, str]) -> dict[int, str]:
    return {p: s for p, s in recorded.items() if (stat := _stat(p)) is not None and stat[1] == s}


def kill_recorded(recorded: dict[int, str]) -> list[int]:
    """SIGKILL each recorded process that is still the same process; return the pids hit."""
    hit = []
    for pid, start in recorded.items():
        stat = _stat(pid)
        if stat is not None and stat[1] == start and pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
                hit.append(pid)
            except OSError:
                pass
    return hit


def watch(driver: int, period_s: float = PERIOD_S) -> None:
    """Record ``driver``'s Ray descendants until stdin closes, then kill the ones still alive."""
    recorded: dict[int, str] = {}
    while True:
        recorded = {**_alive(recorded), **ray_descendants(driver)}
        ready, _, _ = select.select([sys.stdin], [], [], period_s)
        if ready and not os.read(sys.stdin.fileno(), 4096):
            break
    kill_recorded(recorded)


_watcher: subprocess.Popen | None = None


def ensure_started() -> None:
    """Start this process's watcher once; it lives as long as this process, then sweeps."""
    global _watcher
    if _watcher is None or _watcher.poll() is not None:
        _watcher = start()


def start() -> subprocess.Popen | None:
    """Start a watcher for this process (keep the returned handle: its pipe is the lifeline)."""
    if not sys.platform.startswith("linux") or not os.path.isdir("/proc"):
        return None
    return subprocess.Popen([sys.executable, "-S", os.path.abspath(__file__), str(os.getpid())],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)


def stop(handle: subprocess.Popen | None) -> None:
    """Close the lifeline (the watcher sweeps the leftovers and exits); do not wait for it."""
    if handle is not None and handle.stdin is not None:
        try:
            handle.stdin.close()
        except OSError:
            pass


if __name__ == "__main__":
    watch(int(sys.argv[1]))
