"""Re-take the docs' MLflow UI screenshots with a headless browser:

* ``docs/img/mlflow_runs_table.png``: the runs table as ``fedsim ui`` opens it (fedsim's default
  columns: the headline metrics and the params that differ), with the sweep's parent run expanded;
* ``docs/img/mlflow_compare.png``: the compare page of the sweep's children, with ε and α as the
  parameters and ``eval/accuracy`` as the metric of the parallel-coordinates plot.

It uses what the MLflow UI browser test uses: Selenium (a dev dependency) driving Debian's Chromium
and ChromeDriver (``apt-get install chromium chromium-driver``); nothing is downloaded. It starts
``fedsim ui`` itself, on a free port, over the given store:

    fedsim sweep fedavg_digits rounds=10 data.partition.name=dirichlet data.partition.min_partition_size=5 \\
        num_clients=10 --grid eps=1,3,8,.inf data.partition.alpha=0.3,10 --seeds 3
    python docs/make_screenshot.py PARENT_RUN_ID [--tracking-uri sqlite:///mlflow.db]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1600,900", "--hide-scrollbars"]


def compare_url(base: str, parent: str, tracking_uri: str) -> str:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    run = client.get_run(parent)
    kids = client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{parent}'")
    ids = json.dumps([r.info.run_id for r in sorted(kids, key=lambda r: r.info.run_name)])
    exps = json.dumps([run.info.experiment_id])
    return f"{base}/#/compare-runs?runs={urllib.parse.quote(ids)}&experiments={urllib.parse.quote(exps)}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate, timeout: float, what: str):
    deadline = time.time() + timeout
    while not (value := predicate()):
        if time.time() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.5)
    return value


def _start_ui(tracking_uri: str) -> tuple[subprocess.Popen, str, str]:
    """``fedsim ui`` over the store; returns the process, the base address and the address it prints."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "fedsim", "ui", "--port", str(port), "--tracking-uri", tracking_uri],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    url = proc.stdout.readline().split(" at ")[1].split()[0]
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # drain the server's log: a full pipe blocks it
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"fedsim ui exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    _wait(healthy, 120, "the MLflow server")
    return proc, base, url


def _close_assistant(driver) -> None:
    """Close the MLflow Assistant side panel that the UI opens on a first visit."""
    from selenium.webdriver.common.by import By

    for button in reversed(driver.find_elements(By.CSS_SELECTOR, '[aria-label="Close"]')):
        if button.is_displayed():
            button.click()
            return


def runs_table(driver, url: str, out: Path) -> None:
    from selenium.webdriver.common.by import By

    driver.get(url)
    _wait(lambda: driver.find_elements(By.CSS_SELECTOR, "button[data-component-id*='runnamecellrenderer']"), 60,
          "the sweep's parent run in the runs table")
    time.sleep(2)
    _close_assistant(driver)
    shown = len(driver.find_elements(By.CSS_SELECTOR, "a[href*='/runs/']"))
    driver.find_element(By.CSS_SELECTOR, "button[data-component-id*='runnamecellrenderer']").click()  # expand
    _wait(lambda: len(driver.find_elements(By.CSS_SELECTOR, "a[href*='/runs/']")) > shown, 30, "the children")
    time.sleep(2)
    driver.save_screenshot(str(out))


def compare_page(driver, url: str, out: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver.get(url)
    clear = _wait(lambda: [b for b in driver.find_elements(By.TAG_NAME, "button") if b.text.strip() == "Clear All"],
                  60, "the compare page's parallel-coordinates controls")
    time.sleep(3)
    _close_assistant(driver)
    clear[0].click()
    time.sleep(1)
    boxes = driver.find_elements(By.CSS_SELECTOR, "input[role=combobox]")
    params, metrics = boxes[0], boxes[1]
    for box, text in ((params, "privacy.target_epsilon"), (params, "data.partition.alpha"),
                      (metrics, "eval/accuracy")):
        box.click()
        box.send_keys(text)
        time.sleep(0.6)
        box.send_keys(Keys.ENTER)
        box.send_keys(Keys.ESCAPE)
    time.sleep(2)
    driver.find_element(By.TAG_NAME, "body").click()
    time.sleep(1)
    driver.save_screenshot(str(out))


def main() -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    ap = argparse.ArgumentParser()
    ap.add_argument("parent", help="the sweep's parent run id")
    ap.add_argument("--tracking-uri", default="sqlite:///mlflow.db")
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "img"))
    args = ap.parse_args()
    out = Path(args.out_dir)
    proc, base, url = _start_ui(args.tracking_uri)
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for flag in FLAGS:
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
    try:
        runs_table(driver, url, out / "mlflow_runs_table.png")
        compare_page(driver, compare_url(base, args.parent, args.tracking_uri), out / "mlflow_compare.png")
    finally:
        driver.quit()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    print(out / "mlflow_runs_table.png", out / "mlflow_compare.png")


if __name__ == "__main__":
    main()
