"""Headless Chromium driven over the DevTools protocol (its `--remote-debugging-pipe`: JSON messages
on file descriptors 3 and 4, standard library only): open a page at a window size, read its layout
with JavaScript, capture any part of it. tools/screenshots.py and tests/docs/test_site.py use it.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Optional

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-pipe",
]


def chromium_path() -> Optional[str]:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


class Browser:
    """One Chromium process and one page in it. `with Browser() as b: b.open(url); b.evaluate(js)`."""

    def __init__(self, exe: Optional[str] = None, timeout: float = 60.0):
        exe = exe or chromium_path()
        if exe is None:
            raise FileNotFoundError("no Chromium on PATH (Debian: apt-get install chromium)")
        self.profile = tempfile.TemporaryDirectory(prefix="chromium-")
        to_child, self._out = os.pipe()  # we write commands, Chromium reads them on its fd 3
        self._in, from_child = os.pipe()  # Chromium writes replies and events on its fd 4

        def pipes_at_3_and_4():
            os.dup2(to_child, 3)
            os.dup2(from_child, 4)

        self.proc = subprocess.Popen(
            [exe, *FLAGS, f"--user-data-dir={self.profile.name}", "about:blank"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(3, 4),
            preexec_fn=pipes_at_3_and_4,
        )
        os.close(to_child)
        os.close(from_child)
        self.timeout, self._next, self._buffer, self.session = timeout, 0, b"", None
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.send("Page.enable")

    def _read(self) -> dict:
        while b"\0" not in self._buffer:
            chunk = os.read(self._in, 1 << 16)
            if not chunk:
                raise RuntimeError("Chromium closed its DevTools pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def send(self, method: str, **params: Any) -> dict:
        """A DevTools command on the page (the browser before a page is attached); its result."""
        self._next += 1
        message = {"id": self._next, "method": method, "params": params}
        if self.session:
            message["sessionId"] = self.session
        os.write(self._out, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._next:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def wait_for(self, event: str) -> dict:
        while True:
            message = self._read()
            if message.get("method") == event:
                return message.get("params", {})

    def open(self, url: str, width: int = 1400, height: int = 1000) -> None:
        """Load `url` in a window `width` x `height` CSS px, and wait for its load event and fonts."""
        self.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        self.send("Page.navigate", url=url)
        self.wait_for("Page.loadEventFired")
        self.evaluate("document.fonts.ready.then(() => true)")
        self.evaluate("window.scrollTo(0, 0)")  # a page opened again comes back where it was scrolled to

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (a promise is awaited)."""
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def screenshot(self, path: Path, y: float = 0) -> Path:
        """A PNG of the window with the page scrolled to `y` (CSS px from its top; the page's end
        stops it), as a reader sees that screen. Not a capture beyond the window: that resizes
        the window to the page, and the vertical scrollbar's going reflows the page."""
        self.evaluate(
            f"new Promise(done => {{ window.scrollTo(0, {float(y)}); requestAnimationFrame(() => "
            f"requestAnimationFrame(() => done(true))); }})"
        )
        data = self.send("Page.captureScreenshot", format="png")["data"]
        Path(path).write_bytes(base64.b64decode(data))
        return Path(path)

    def close(self) -> None:
        try:
            self.send("Browser.close")
        except (RuntimeError, OSError):
            pass
        try:
            self.proc.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.close(self._in)
        os.close(self._out)
        self.profile.cleanup()

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
