"""Stress the run lifecycle: interrupt a process that logs MLflow metrics at random moments.

    .venv/bin/python scripts/interrupt_stress.py [--trials 15] [--signal SIGTERM|SIGINT]

Each trial starts a child that opens a tracked run on a fresh sqlite store and logs 20-metric
batches in a loop, sends it the signal after a random 0.2-1.5 s, and reads the run's final status
from the store. Every run must end KILLED; before `fedsim.run_lifecycle.interrupts_deferred`, an
interrupt inside a store write left 3 of 15 (SIGTERM) and 2 of 12 (SIGINT) runs RUNNING.
"""

from __future__ import annotations

import argparse
import collections
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(uri: str) -> None:
    from fedsim.run_lifecycle import tracked_run
    from fedsim.tracking import MlflowRecorder

    rec = MlflowRecorder(uri, "stress", "r", {})
    print("ready", flush=True)
    with tracked_run(rec):
        step = 0
        while True:
            rec.log_metrics({f"m{i}": float(step) for i in range(20)}, step)
            step += 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=15)
    ap.add_argument("--signal", default="SIGTERM", choices=["SIGTERM", "SIGINT"])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return 0
    statuses: collections.Counter[str] = collections.Counter()
    with tempfile.TemporaryDirectory() as tmp:
        for trial in range(args.trials):
            db = Path(tmp) / f"trial{trial}.db"
            proc = subprocess.Popen([sys.executable, __file__, "--child", f"sqlite:///{db}"],
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            proc.stdout.readline()  # the run exists
            time.sleep(random.uniform(0.2, 1.5))
            proc.send_signal(getattr(signal, args.signal))
            proc.wait(timeout=120)
            status = sqlite3.connect(db).execute("select status from runs").fetchone()[0]
            statuses[status] += 1
            print(f"trial {trial + 1}/{args.trials}: {status}", flush=True)
    print(f"{args.signal}: {dict(statuses)}")
    return 0 if set(statuses) == {"KILLED"} else 1


if __name__ == "__main__":
    sys.exit(main())
