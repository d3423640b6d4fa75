"""The system's Chromium, driven by Playwright (the chat page's tests and the server's origin tests):
found, or the test skipped with the reason (under CI, where scripts/test installs it, failed)."""
from __future__ import annotations

import contextlib
import os
import shutil

import pytest

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def chromium_path() -> str | None:
    """The system's Chromium: $GGUFSPEC_CHROMIUM when set, else Debian's (or another distribution's) on PATH."""
    given = os.environ.get("GGUFSPEC_CHROMIUM")
    candidates = [given] if given else [shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def browser_missing(reason: str):
    if os.environ.get("CI"):  # CI installs the browser (scripts/test): its absence is a failure there
        pytest.fail(reason)
    pytest.skip(reason)


@contextlib.contextmanager
def chromium(*args: str):
    """A launched headless Chromium (Playwright's Browser), with `args` added to CHROMIUM_ARGS."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        browser_missing("the browser test needs Playwright: pip install 'ggufspec[test]'")
    executable = chromium_path()
    if executable is None:
        browser_missing("no Chromium for the browser test: apt-get install chromium (or set GGUFSPEC_CHROMIUM)")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=executable, args=[*CHROMIUM_ARGS, *args])
        try:
            yield launched
        finally:
            launched.close()
