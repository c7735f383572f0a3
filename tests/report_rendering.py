"""Render an artifact's report.html in headless Chromium and find each plot's colour in the screenshot."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
from PIL import Image

from tensorsmith.compiler.report import plots as report_plots

# The flags the workplace's probe uses: no sandbox as root, no GPU, and no background network traffic (this
# machine's network is closed).
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    raise AssertionError("no Chromium on PATH: `make test` installs Debian's chromium (apt-get install chromium)")


def screenshot(html: Path, png: Path, height: int = 8000) -> np.ndarray:
    """The page rendered at 1200 × `height` pixels, as an RGB array."""
    profile = png.parent / f"{png.stem}-profile"
    command = [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size=1200,{height}",
               f"--screenshot={png}", html.resolve().as_uri()]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, timeout=120)
    with Image.open(png) as image:
        return np.asarray(image.convert("RGB"))


def dom(html: Path, scratch: Path) -> str:
    """The document as Chromium parsed it (what a browser holds after loading the file)."""
    command = [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={scratch / 'dom-profile'}", "--dump-dom",
               html.resolve().as_uri()]  # fmt: skip
    return subprocess.run(command, check=True, capture_output=True, timeout=120, text=True).stdout


def pixels_of(image: np.ndarray, colour: str) -> int:
    """How many pixels have exactly `colour` ('#rrggbb'): marks drawn only by one kind of plot."""
    rgb = np.array([int(colour[i : i + 2], 16) for i in (1, 3, 5)], dtype=np.uint8)
    return int(np.all(image == rgb, axis=-1).sum())


def check_report_renders(artifact: Path, scratch: Path, quantized: bool) -> None:
    """report.html renders with its plots: step bars always; with quantization, histograms and thresholds too."""
    html = artifact / "report.html"
    assert "<script" not in html.read_text(), "the report must not run or fetch scripts"
    parsed = dom(html, scratch)
    assert parsed.count("<svg") >= (3 if quantized else 1)
    image = screenshot(html, scratch / f"{artifact.name}-report.png")
    assert pixels_of(image, report_plots.BAR_COLOUR) > 2000  # bar charts are on the page, drawn
    if quantized:
        assert pixels_of(image, report_plots.HISTOGRAM_COLOUR) > 2000
        assert pixels_of(image, report_plots.THRESHOLD_COLOUR) > 100
    else:
        assert pixels_of(image, report_plots.HISTOGRAM_COLOUR) == 0
