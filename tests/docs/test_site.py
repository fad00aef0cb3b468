"""The docs site as a reader sees it at 1400 px, laid out by headless Chromium (tools/browser.py, as
tools/screenshots.py uses it): the configuration reference never breaks a field's name across lines,
and the guides' code blocks fit or scroll."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))  # tools/ is scripts, not a package
from browser import Browser, chromium_path  # noqa: E402

WIDTH = 1400
# The first-column names of every table, and the ones laid out on more than one line.
NAMES = """[...document.querySelectorAll('.md-content td:first-child code')].map(c => [c.textContent, c.getClientRects().length])"""
# Every code block: [its first line, its content's width, its box's width, its overflow-x].
CODE = """[...document.querySelectorAll('.md-content pre > code')].map(c =>
    [c.textContent.split('\\n')[0], c.scrollWidth, c.clientWidth, getComputedStyle(c).overflowX])"""


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """This checkout's site, built as CI builds it."""
    if chromium_path() is None:
        if os.environ.get("CI"):
            pytest.fail("CI must provide Chromium: .ci/run installs Debian's chromium package")
        pytest.skip("no chromium (apt-get install chromium)")
    pytest.importorskip("mkdocs", reason="the docs extra: pip install -c constraints.txt -e '.[docs]'")
    out = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
        cwd=ROOT,
        check=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=600,
    )
    return out


@pytest.fixture(scope="module")
def browser(site):
    with Browser() as b:
        yield b


def test_the_configuration_reference_never_breaks_a_name(site, browser):
    browser.open((site / "reference" / "config" / "index.html").as_uri(), WIDTH)
    names = browser.evaluate(NAMES)
    assert len(names) > 300
    assert [name for name, lines in names if lines > 1] == []  # e.g. "trainer.st / eps" in two lines


def test_the_guides_code_blocks_fit_or_scroll(site, browser):
    pages = sorted((site / "guides").glob("*/index.html"))
    assert len(pages) >= 10
    cut = []
    for page in pages:
        browser.open(page.as_uri(), WIDTH)
        blocks = browser.evaluate(CODE)
        cut += [
            (page.parent.name, first)
            for first, content, box, overflow in blocks
            if content > box and overflow not in ("auto", "scroll")
        ]
        if page.parent.name == "members":  # the block issue 53 found cut off on the right: it fits
            first, content, box, _ = blocks[0]
            assert content <= box, (first, content, box)
    assert cut == []
