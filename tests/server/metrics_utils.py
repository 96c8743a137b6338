"""Helpers for the observability tests: parse ``/metrics``, find system binaries (missing ones fail the test)."""

from __future__ import annotations

import random
import shutil

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families


def scrape(base_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics`` as {(sample name, sorted labels without model_name): value}."""
    response = httpx.get(f"{base_url}/metrics", timeout=10)
    response.raise_for_status()
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            samples[(sample.name, labels)] = sample.value
    return samples


def families(base_url: str) -> dict[str, str]:
    """Metric family name → type, as the parser sees them."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


# Headless Chromium as the browser tests run it (Debian's package, driven by Playwright).
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def require_binary(name: str) -> str:
    """The binary's path; the test fails (never skips) without it: ``scripts/install-system-deps.sh`` installs it."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed; run scripts/install-system-deps.sh (make test does)")
    return path


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(length)]
