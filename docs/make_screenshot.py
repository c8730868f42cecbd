"""Re-take the README's MLflow UI screenshot (docs/img/mlflow_compare.png) with a headless browser.

Not part of the project's install: it needs Playwright (``pip install playwright`` in any venv) and
Debian's Chromium (``apt-get install chromium``); Playwright's own browser download is not used.

    fedsim sweep fedavg_digits rounds=10 data.partition.name=dirichlet data.partition.min_partition_size=5 \\
        num_clients=10 --grid eps=1,3,8,.inf data.partition.alpha=0.3,10 --seeds 3
    fedsim ui --port 5055 &
    python docs/make_screenshot.py PARENT_RUN_ID [--tracking-uri sqlite:///mlflow.db]

It opens the MLflow compare page of the sweep's children, selects ε and α as parameters and
``eval/accuracy`` as the metric of the parallel-coordinates plot, and saves the screenshot.
"""

from __future__ import annotations

import argparse
import json
import urllib.parse


def compare_url(parent: str, tracking_uri: str, port: int) -> str:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    run = client.get_run(parent)
    kids = client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{parent}'")
    ids = json.dumps([r.info.run_id for r in sorted(kids, key=lambda r: r.info.run_name)])
    exps = json.dumps([run.info.experiment_id])
    return f"http://127.0.0.1:{port}/#/compare-runs?runs={urllib.parse.quote(ids)}&experiments={urllib.parse.quote(exps)}"


def main() -> None:
    from playwright.sync_api import sync_playwright

    ap = argparse.ArgumentParser()
    ap.add_argument("parent")
    ap.add_argument("--tracking-uri", default="sqlite:///mlflow.db")
    ap.add_argument("--port", type=int, default=5055)
    ap.add_argument("--out", default="docs/img/mlflow_compare.png")
    args = ap.parse_args()
    url = compare_url(args.parent, args.tracking_uri, args.port)
    flags = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
             "--disable-sync", "--disable-quic"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=flags)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(url)
        page.wait_for_timeout(8000)
        page.locator('[aria-label="Close"]').last.click(timeout=5000)  # the assistant side panel
        page.get_by_role("button", name="Clear All").click()
        params, metrics = page.locator("input[role=combobox]").nth(0), page.locator("input[role=combobox]").nth(1)
        for box, text in ((params, "privacy.target_epsilon"), (params, "data.partition.alpha"),
                          (metrics, "eval/accuracy")):
            box.click()
            box.fill(text)
            page.wait_for_timeout(400)
            page.keyboard.press("Enter")
            page.keyboard.press("Escape")
        page.wait_for_timeout(2000)
        page.mouse.click(5, 5)
        page.screenshot(path=args.out)
        browser.close()
    print(args.out)


if __name__ == "__main__":
    main()
