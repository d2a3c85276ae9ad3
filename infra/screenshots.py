"""Headless Chromium screenshots of a run in the MLflow UI: the run page and its two plots.

Used by `make docs-screenshots` and tests/test_registry_mlflow.py, so docs/ shows what a run
looks like. Chromium runs with a fresh profile, no sandbox/GPU/background traffic, on loopback.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--hide-scrollbars", "--window-size=1440,1000",
         "--virtual-time-budget=20000"]
#: screenshot name -> artifact path of the run (None: the run page itself)
PLOTS = {"quality_vs_params_removed": "plots/quality_vs_params_removed.png"}


class ScreenshotError(RuntimeError):
    """Chromium is missing or produced no image."""


def chromium_binary() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def capture(url: str, out: Path, timeout: float = 180) -> Path:
    """One screenshot of `url` into `out` (PNG) with a throwaway profile."""
    binary = chromium_binary()
    if binary is None:
        raise ScreenshotError("chromium not found (Debian: apt-get install chromium)")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pipprune-chromium-") as profile:
        done = subprocess.run([binary, *FLAGS, f"--user-data-dir={profile}", f"--screenshot={out}", url],
                              capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0 or not out.is_file():
        raise ScreenshotError(f"chromium could not capture {url}: {done.stderr[-1500:]}")
    return out


def run_url(tracking_uri: str, run_id: str, artifact: str | None = None) -> str:
    """The MLflow UI's page of a run (or of one of its artifacts), in the classic machine-learning view."""
    from mlflow import MlflowClient

    run = MlflowClient(tracking_uri).get_run(run_id)
    base = f"{tracking_uri.rstrip('/')}/#/experiments/{run.info.experiment_id}/runs/{run_id}"
    view = "?workflowType=machine_learning"  # a fresh browser profile opens MLflow's UI in GenAI mode
    return f"{base}/artifacts/{artifact}{view}" if artifact else base + view


def screenshot_artifact(tracking_uri: str, run_id: str, artifact: str, out: Path) -> Path:
    """One artifact of a run as the MLflow UI shows it (a sweep's Pareto plot, for the README)."""
    return capture(run_url(tracking_uri, run_id, artifact), Path(out))


def screenshot_run(tracking_uri: str, run_id: str, out_dir: Path) -> dict[str, Path]:
    """The run page, the quality curve and the last step's unit scores, as shown by the MLflow UI."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    run = client.get_run(run_id)
    base = f"{tracking_uri.rstrip('/')}/#/experiments/{run.info.experiment_id}/runs/{run_id}"
    steps = sorted(a.path for a in client.list_artifacts(run_id, "iterations"))
    scores = next((f"{p}/unit_scores.png" for p in reversed(steps)
                   if any(a.path.endswith("unit_scores.png") for a in client.list_artifacts(run_id, p))), None)
    if scores is None:
        raise ScreenshotError(f"run {run_id} has no unit_scores.png artifact")
    view = "?workflowType=machine_learning"  # a fresh browser profile opens MLflow's UI in GenAI mode
    targets = {"run_page": base + view, **{name: f"{base}/artifacts/{path}{view}" for name, path in PLOTS.items()},
               "unit_scores": f"{base}/artifacts/{scores}{view}"}
    return {name: capture(url, Path(out_dir) / f"mlflow_{name}.png") for name, url in targets.items()}
