"""The sweep report in a real headless browser (Debian's chromium): the page loads with no
console error or exception, every image has decoded, and a screenshot is taken.

Chromium is driven over its DevTools protocol on a pipe (--remote-debugging-pipe: JSON messages
ending in NUL on file descriptors 3 and 4), so the test needs no driver package and no port.
It skips where no chromium is installed (`apt-get install chromium`)."""
import base64
import json
import os
import select
import shutil
import subprocess
import time

import pytest

from shmlearn.report import write_report

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


class DevTools:
    def __init__(self, profile):
        r_cmd, self._w = os.pipe()   # we write commands, chromium reads fd 3
        self._r, w_evt = os.pipe()   # chromium writes fd 4, we read

        def fds():
            os.dup2(r_cmd, 3)
            os.dup2(w_evt, 4)
        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
             "--remote-debugging-pipe", f"--user-data-dir={profile}", "--window-size=1280,900", "about:blank"],
            preexec_fn=fds, close_fds=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(r_cmd)
        os.close(w_evt)
        self._buf, self._id, self.events = b"", 0, []

    def _read(self, deadline):
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._r], [], [], left)[0]:
                raise TimeoutError("chromium did not answer")
            chunk = os.read(self._r, 1 << 20)
            if not chunk:
                raise EOFError("chromium closed the pipe")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def call(self, method, session=None, timeout=30, **params):
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            m = self._read(deadline)
            if m.get("id") == self._id:
                assert "error" not in m, m
                return m["result"]
            self.events.append(m)

    def wait_event(self, method, timeout=30):
        deadline = time.monotonic() + timeout
        while not any(e.get("method") == method for e in self.events):
            self.events.append(self._read(deadline))

    def close(self):
        try:
            self.call("Browser.close", timeout=5)
        except (EOFError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._w)
        os.close(self._r)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium installed (apt-get install chromium)")
def test_sweep_report_loads_in_chromium_without_errors(fake_sweep, tmp_path):
    page = write_report([str(fake_sweep)])
    dt = DevTools(tmp_path / "profile")
    try:
        target = dt.call("Target.createTarget", url="about:blank")["targetId"]
        s = dt.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            dt.call(f"{domain}.enable", session=s)
        dt.call("Page.navigate", session=s, url="file://" + os.path.abspath(page))
        dt.wait_event("Page.loadEventFired")
        decoded = dt.call("Runtime.evaluate", session=s, awaitPromise=True, returnByValue=True, expression="""
            Promise.all(Array.from(document.images).map(
                img => img.decode().then(() => [img.naturalWidth, img.naturalHeight], () => 'failed')))
        """)["result"]["value"]
        shot = dt.call("Page.captureScreenshot", session=s, format="png", captureBeyondViewport=True)
        errors = [e for e in dt.events
                  if e.get("method") == "Runtime.exceptionThrown"
                  or (e.get("method") == "Runtime.consoleAPICalled" and e["params"]["type"] in ("error", "assert"))
                  or (e.get("method") == "Log.entryAdded" and e["params"]["entry"]["level"] == "error")]
    finally:
        dt.close()
    assert not errors, errors
    assert len(decoded) >= 8, decoded
    assert all(isinstance(d, list) and d[0] >= 400 and d[1] >= 200 for d in decoded), decoded
    png = base64.b64decode(shot["data"])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "screenshot.png").write_bytes(png)
    from PIL import Image
    with Image.open(tmp_path / "screenshot.png") as im:
        assert im.size[0] >= 1000 and im.size[1] > 2000  # the whole page, every figure in it
    if os.environ.get("SHMLEARN_SCREENSHOT"):
        shutil.copy(tmp_path / "screenshot.png", os.environ["SHMLEARN_SCREENSHOT"])
