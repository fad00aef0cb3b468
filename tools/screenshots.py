"""Screenshots of the docs site (and of any HTML page, e.g. a report) as a reader sees it: headless
Chromium at a desktop width (1400 px), one PNG per page or `#anchor`, to look at before a change to
a page's layout is called done (docs/development.md, "The documentation").

    python tools/screenshots.py                           # the configuration reference and the members guide
    python tools/screenshots.py --out shots reference/config/#optim-shampoo guides/members/
    python tools/screenshots.py reports/first/index.html  # a report (any .html file)

A target is a page of the site (its path under site/, as in its URL; `#anchor` shows the screen
that starts at that heading) or an .html file. The site is built from this checkout
(`mkdocs build --strict`) unless --site names a built one. Needs Chromium (Debian: apt-get install
chromium) and the docs extra (MkDocs).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from browser import Browser

ROOT = Path(__file__).resolve().parents[1]
# The pages issue 53 found hard to read at 1400 px: the reference's tables, the members guide's first code block.
DEFAULT = [
    "reference/config/",
    "reference/config/#run-level-fields",
    "reference/config/#optim-shampoo",
    "reference/config/#tracker-wandb",
    "guides/members/",
]


def build_site(site: Path) -> None:
    """`mkdocs build --strict` of this checkout into `site`."""
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(site)], cwd=ROOT, check=True
    )


def page_url(target: str, site: Path) -> tuple[str, str]:
    """(a file URL, the anchor or ''): an .html file as it is, a site page as site/<path>/index.html."""
    path, _, anchor = target.partition("#")
    page = Path(path).resolve() if path.endswith(".html") else site / path.strip("/") / "index.html"
    if not page.is_file():
        sys.exit(f"error: {target}: no page at {page}")
    return page.as_uri(), anchor


def shoot(browser: Browser, target: str, site: Path, out: Path, width: int, height: int) -> Path:
    """The screen of `target` as <out>/<target>.png: from its anchor's heading, if it names one (80 px above
    it: the site's header covers the window's top)."""
    url, anchor = page_url(target, site)
    browser.open(url, width, height)
    y = 0.0
    if anchor:
        y = browser.evaluate(
            f"(e => e ? e.getBoundingClientRect().top + window.scrollY : null)(document.getElementById({anchor!r}))"
        )
        if y is None:
            sys.exit(f"error: {target}: the page has no element with id {anchor!r}")
        y = max(0.0, y - 80)
    name = re.sub(r"[^\w.-]+", "-", target.replace("index.html", "")).strip("-") or "index"
    return browser.screenshot(out / f"{name}.png", y=y)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python tools/screenshots.py", description=__doc__.splitlines()[0])
    ap.add_argument(
        "targets",
        nargs="*",
        default=DEFAULT,
        help=f"site pages (path[#anchor]) or .html files (default: {' '.join(DEFAULT)})",
    )
    ap.add_argument("--out", default="screenshots", help="folder of the PNGs (default: screenshots)")
    ap.add_argument("--site", help="a built site (default: build this checkout's into a temporary folder)")
    ap.add_argument("--width", type=int, default=1400, help="window width in CSS px (default 1400)")
    ap.add_argument("--height", type=int, default=1000, help="window and screenshot height in CSS px (default 1000)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(args.site) if args.site else Path(tmp) / "site"
        if not args.site and any(not t.partition("#")[0].endswith(".html") for t in args.targets):
            build_site(site)
        with Browser() as browser:
            for target in args.targets:
                print(shoot(browser, target, site, out, args.width, args.height))


if __name__ == "__main__":
    main()
