"""Headless Chromium driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`:
JSON messages ended by NUL on fds 3 and 4; no port, no WebSocket client needed), so a test can
watch a page in real time (wait for a condition with a deadline, then take a screenshot) from
the event loop that serves it. `--dump-dom` with a virtual time budget cannot: the page's clock
then runs ahead of the servers it polls."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import subprocess
import tempfile
from collections.abc import AsyncIterator
from typing import Any


class Page:
    def __init__(self, reader: asyncio.StreamReader, write_fd: int) -> None:
        self._reader = reader
        self._write_fd = write_fd
        self._ids = itertools.count(1)
        self.session = ""

    async def call(self, method: str, timeout: float = 30.0, **params: Any) -> dict[str, Any]:
        """One command; its result (events in between are skipped)."""
        n = next(self._ids)
        msg: dict[str, Any] = {"id": n, "method": method, "params": params}
        if self.session and not method.startswith(("Target.", "Browser.")):
            msg["sessionId"] = self.session
        os.write(self._write_fd, json.dumps(msg).encode() + b"\0")
        while True:
            raw = await asyncio.wait_for(self._reader.readuntil(b"\0"), timeout)
            got = json.loads(raw[:-1])
            if got.get("id") == n:
                if "error" in got:
                    raise RuntimeError(f"{method}: {got['error']}")
                result: dict[str, Any] = got.get("result", {})
                return result

    async def evaluate(self, expression: str) -> Any:
        got = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return got.get("result", {}).get("value")

    async def screenshot(self) -> bytes:
        got = await self.call("Page.captureScreenshot", format="png")
        return base64.b64decode(got["data"])


@contextlib.asynccontextmanager
async def open_page(binary: str, flags: list[str], url: str, width: int, height: int) -> AsyncIterator[Page]:
    """Chromium showing `url` in a `width` x `height` viewport, stopped on exit."""
    to_chrome_r, to_chrome_w = os.pipe()
    from_chrome_r, from_chrome_w = os.pipe()
    with tempfile.TemporaryDirectory() as profile:
        # bash (dash takes one-digit fds only) puts the pipe ends at the fds Chromium expects,
        # then becomes Chromium. Popen: uvloop's subprocess does not keep pass_fds' numbers.
        proc = subprocess.Popen(
            ["bash", "-c", f'exec "$0" "$@" 3<&{to_chrome_r} 4>&{from_chrome_w}', binary, *flags,
             f"--user-data-dir={profile}", "--remote-debugging-pipe", f"--window-size={width},{height}",
             "about:blank"], pass_fds=(to_chrome_r, from_chrome_w),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=64 << 20)  # a screenshot arrives as one message
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(from_chrome_r, "rb", 0))
        page = Page(reader, to_chrome_w)
        try:
            target = await page.call("Target.createTarget", url="about:blank")
            attached = await page.call("Target.attachToTarget", targetId=target["targetId"], flatten=True)
            page.session = attached["sessionId"]
            await page.call("Emulation.setDeviceMetricsOverride", width=width, height=height,
                            deviceScaleFactor=1, mobile=False)
            await page.call("Page.enable")
            await page.call("Page.navigate", url=url)
            yield page
        finally:
            with contextlib.suppress(Exception):
                await page.call("Browser.close", timeout=5)
            transport.close()
            os.close(to_chrome_w)
            try:
                await asyncio.wait_for(asyncio.to_thread(proc.wait), 10)
            except TimeoutError:
                proc.kill()
                await asyncio.to_thread(proc.wait)
