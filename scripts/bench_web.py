"""The chat page's speed in a real browser: Debian's chromium, headless, driven by Selenium, against
`pagedchat serve -m demo` started as a user starts it.

    python scripts/bench_web.py [--repeats 5] [--json]

- first paint: the page's first contentful paint after navigation (the browser's own Paint Timing entry);
- token to screen: for every streamed piece of a reply, the time from the server's chat layer receiving it to
  the page's frame that draws it (both clocks are this machine's wall clock);
- a 500-message session: from clicking it in the session list to the frame that shows it.

tests/test_web_browser.py drives the page with the same helpers (chromium(), wait_until()).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

CHROMIUM = ("chromium", "chromium-browser", "google-chrome")
DRIVER = ("chromedriver",)


def browser_paths() -> tuple[str, str] | None:
    """(browser, driver) executables, or None when either is missing."""
    browser = next((p for p in map(shutil.which, CHROMIUM) if p), None)
    driver = next((p for p in map(shutil.which, DRIVER) if p), None)
    return (browser, driver) if browser and driver else None


def chromium(download_dir: Path | None = None, width: int = 1400, height: int = 900):
    """A headless chromium under Selenium (root in a container: no sandbox; /dev/shm may be small)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver = browser_paths() or (None, None)
    assert browser and driver, "chromium and chromedriver are needed (Debian: apt install chromium chromium-driver)"
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={width},{height}", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    if download_dir is not None:
        options.add_experimental_option("prefs", {"download.default_directory": str(download_dir),
                                                  "download.prompt_for_download": False})
    drv = webdriver.Chrome(options=options, service=Service(driver))
    if download_dir is not None:
        drv.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(download_dir)})
    return drv


def wait_until(condition, timeout: float = 30.0, what: str = "the page"):
    """Poll condition() until it returns something truthy; that value. An element not there yet, or one the
    page redrew between finding and reading it, counts as not yet."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException

    deadline = time.monotonic() + timeout
    while True:
        try:
            value = condition()
        except (NoSuchElementException, StaleElementReferenceException):
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def click(driver, selector: str) -> None:
    """Click the element once the page shows it (the page redraws lists as they change)."""
    wait_until(lambda: driver.find_element("css selector", selector).click() or True, what=selector)


def open_page(driver, url: str) -> None:
    driver.get(url)
    wait_until(lambda: driver.execute_script("return document.documentElement.dataset.ready === 'true'"),
               what="the page to start")


def first_paint_ms(driver) -> float:
    return driver.execute_script(
        "const e = performance.getEntriesByName('first-contentful-paint')[0]; return e ? e.startTime : null;")


def send_and_wait(driver, text: str) -> None:
    from selenium.webdriver.common.by import By

    before = driver.execute_script("const s = window.__pagedchat.session; return s ? s.nodes.length : 0")
    driver.find_element(By.CSS_SELECTOR, "textarea[name=message]").send_keys(text)
    click(driver, "[data-action=send]")
    wait_for_reply(driver, after=before)


def wait_for_reply(driver, timeout: float = 60.0, after: int | None = None) -> None:
    """Until no turn streams and every message shown has its node id (the turn's `done` arrived); with `after`,
    also until the session holds more than that many nodes (the turn may not have started yet)."""
    wait_until(lambda: driver.execute_script(
        "const s = window.__pagedchat.session;"
        "return window.__pagedchat.streaming === null && !document.querySelector('[data-node-id=\"\"]')"
        " && (arguments[0] === null || (s !== null && s.nodes.length > arguments[0]))", after),
        timeout, "the reply to finish")


def token_to_screen_ms(driver) -> list[float]:
    paints = driver.execute_script("return window.__pagedchat.paints")
    return [p["painted_t"] - p["server_t"] for p in paints]


def write_long_session(store: Path, name: str, messages: int) -> None:
    """A saved session of `messages` messages (half user, half replies) made the way the chat layer makes one,
    on the demo model, without generating: the ids are the texts' own."""
    from pagedchat.chat.session import Session
    from pagedchat.chat.store import SessionStore
    from pagedchat.chat.turns import Templater
    from pagedchat.model.loader import load_tokenizer
    from pagedchat.registry import Registry

    entry = Registry().resolve("demo")
    tok = load_tokenizer(Path(entry.path))
    templater = Templater(tok, [tok.eos_token_id])
    session = Session(name, model=entry.name, model_path=str(entry.path), fingerprint=templater.fingerprint())
    parent = None
    for i in range(messages // 2):
        question = f"Question {i}: what is {i} + {i}? Please answer with **Markdown**, `code` and a list."
        user = session.tree.add(parent, "user", question, templater.encode(question))
        answer = f"The answer to question {i} is **{2 * i}**.\n\n- one\n- two\n\n```python\nprint({i} + {i})\n```"
        parent = session.tree.add(user.id, "assistant", answer, templater.encode(answer)).id
    session.head = parent
    SessionStore(store).save(session)


class Server:
    """`pagedchat serve -m demo --port 0` in a subprocess with its own data folder; .url once it listens."""

    def __init__(self, data: Path, *extra: str):
        env = {**os.environ, "XDG_DATA_HOME": str(data), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "pagedchat.cli", "serve", "-m", "demo", "--port", "0",
                                      *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in self.proc.stdout], daemon=True).start()
        while True:
            line = lines.get(timeout=120)
            found = re.search(r"chat page at (\S+)", line)
            if found:
                self.url = found[1]
                return

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def measure(repeats: int) -> dict:
    from pagedchat.bench.common import machine_description

    data = Path(tempfile.mkdtemp(prefix="pagedchat-web-bench-"))
    write_long_session(data / "pagedchat" / "sessions", "long", 500)
    server = Server(data)
    paint, latency, opened = [], [], []
    try:
        for _ in range(repeats):
            driver = chromium()
            try:
                open_page(driver, server.url)     # opens the most recent session: the 500-message one
                paint.append(first_paint_ms(driver))
                click(driver, "[data-action=new-session]")
                wait_until(lambda: driver.execute_script("return window.__pagedchat.session && "
                                                         "window.__pagedchat.session.nodes.length === 0"))
                send_and_wait(driver, "Hello! Tell me what you can do.")
                latency += token_to_screen_ms(driver)
                click(driver, '[data-session="long"]')
                wait_until(lambda: driver.execute_script("return window.__pagedchat.session.name === 'long' && "
                                                         "window.__pagedchat.timings.open_ms"), what="the long session")
                opened.append(driver.execute_script("return window.__pagedchat.timings.open_ms"))
            finally:
                driver.quit()
    finally:
        server.close()
        shutil.rmtree(data, ignore_errors=True)
    q = statistics.quantiles(latency, n=20) if len(latency) > 1 else latency * 19
    return {"command": f"python scripts/bench_web.py --repeats {repeats}", "date": time.strftime("%Y-%m-%d"),
            "machine": machine_description(), "browser": chromium_version(), "repeats": repeats,
            "first_paint_ms": statistics.median(paint), "token_to_screen_ms": {
                "median": statistics.median(latency), "p95": q[18], "max": max(latency), "pieces": len(latency)},
            "open_500_messages_ms": statistics.median(opened),
            "runs": {"first_paint_ms": paint, "open_500_messages_ms": opened}}


def chromium_version() -> str:
    browser = (browser_paths() or ("chromium",))[0]
    out = subprocess.run([browser, "--version"], capture_output=True, text=True).stdout.strip()
    return out.splitlines()[-1] if out else "chromium"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout instead of the summary")
    a = ap.parse_args()
    if browser_paths() is None:
        raise SystemExit("bench_web: chromium and chromedriver are needed (apt install chromium chromium-driver)")
    r = measure(a.repeats)
    if a.json:
        print(json.dumps(r, indent=1))
        return
    t = r["token_to_screen_ms"]
    print(f"first paint {r['first_paint_ms']:.0f} ms; token to screen median {t['median']:.1f} ms, p95 "
          f"{t['p95']:.1f} ms ({t['pieces']} pieces); 500-message session opens in {r['open_500_messages_ms']:.0f} ms")


if __name__ == "__main__":
    main()
