"""The operator dashboard in a real browser: Debian's headless Chromium, driven through its own
chromedriver, opens the link `onedoor demo` prints, after one of the demo's upstreams has tripped
its circuit breaker. The page must render without a console error and show that breaker open.

A full-page screenshot is saved to $ONEDOOR_ARTIFACTS/dashboard.png (default
target/e2e-artifacts/dashboard.png in the repository) for CI to keep.
"""

import base64
import json
import os
import pathlib
import re
import time
import urllib.error
import urllib.request

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
BROKEN = "sub3-eastus"
REPO = pathlib.Path(__file__).resolve().parents[2]
WIDTH = 1440


def artifacts() -> pathlib.Path:
    folder = pathlib.Path(os.environ.get("ONEDOOR_ARTIFACTS") or REPO / "target" / "e2e-artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def dashboard_link(demo) -> tuple[str, str]:
    found = re.search(r"^(http://\S+)/dashboard#token=(\S+)\s*$", demo.text, re.M)
    assert found, f"the demo prints no dashboard link:\n{demo.text}"
    return found.group(1), found.group(2)


def request(url: str, headers: dict, body: dict | bytes | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=30) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def breaker_state(admin: str, token: str, backend: str) -> str:
    status, body = request(f"{admin}/admin/backends", {"authorization": f"Bearer {token}"})
    assert status == 200, body
    return next(b["breaker"]["state"] for b in body["backends"] if b["name"] == backend)


def upstream_url(demo, name: str) -> str:
    found = re.search(rf"^\s+{re.escape(name)}\s+(http://\S+)\s*$", demo.text, re.M)
    assert found, f"the demo lists no upstream {name}:\n{demo.text}"
    return found.group(1)


def trip_a_breaker(demo, admin: str, token: str) -> None:
    """Some answers, then the only upstream with gpt-4.1 resets every connection (through its
    `/_mock/` control API): two connect errors within 30 s open its breaker (the demo's
    `unreachable` rule), and the requests for gpt-4.1 fail."""
    key = {"authorization": f"Bearer {demo.key}"}
    chat = {"model": "chat-default", "max_tokens": 8, "messages": [{"role": "user", "content": "Hello"}]}
    for _ in range(4):
        status, body = request(f"{demo.url}/v1/chat/completions", key, chat)
        assert status == 200, body
    mock = urllib.request.Request(f"{upstream_url(demo, BROKEN)}/_mock/behavior", data=b'{"reset": true}', method="PUT")
    with urllib.request.urlopen(mock, timeout=10) as answer:
        assert answer.status == 200
    for _ in range(5):
        if breaker_state(admin, token, BROKEN) == "open":
            break
        status, body = request(f"{demo.url}/v1/chat/completions", key, {**chat, "model": "gpt-4.1"})
        assert status >= 400, body
    assert breaker_state(admin, token, BROKEN) == "open"
    # Two more for the error tables: a body that is not JSON, and a wrong key.
    assert request(f"{demo.url}/v1/chat/completions", key, b"{")[0] == 400
    assert request(f"{demo.url}/v1/chat/completions", {"authorization": "Bearer wrong"}, chat)[0] == 401


@pytest.fixture
def browser():
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        pytest.fail(f"{CHROMIUM} and {CHROMEDRIVER} are needed (tests/e2e/run installs Debian's chromium and chromium-driver)", pytrace=False)
    options = Options()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-dev-shm-usage", f"--window-size={WIDTH},1000", "--hide-scrollbars"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def full_page_png(driver) -> bytes:
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": WIDTH, "height": height, "deviceScaleFactor": 1, "mobile": False})
    # Two animation frames: the page has laid itself out and painted at the new size.
    driver.execute_async_script("const done = arguments[0]; requestAnimationFrame(() => requestAnimationFrame(done));")
    shot = driver.execute_cdp_cmd("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
    return base64.b64decode(shot["data"])


def renders(driver) -> int:
    return int(driver.find_element(By.TAG_NAME, "body").get_attribute("data-renders") or 0)


def test_the_dashboard_shows_the_tripped_breaker_without_console_errors(own_demo, browser, capsys):
    admin, token = dashboard_link(own_demo)
    trip_a_breaker(own_demo, admin, token)

    browser.get(f"{admin}/dashboard#token={token}")
    cell = f'tr[data-backend="{BROKEN}"] td[data-breaker]'
    WebDriverWait(browser, 15).until(lambda d: d.find_elements(By.CSS_SELECTOR, cell))
    state = browser.find_element(By.CSS_SELECTOR, cell)
    assert state.get_attribute("data-breaker") == "open", state.text
    assert "open" in state.text and "probe in" in state.text, state.text
    assert browser.find_element(By.ID, "status").get_attribute("data-state") == "live"
    assert "#token" not in browser.current_url, "the token stays out of the address bar"
    # The errors of the trip above are listed.
    WebDriverWait(browser, 10).until(lambda d: d.find_elements(By.CSS_SELECTOR, '#codes tr[data-code="invalid_api_key"]'))
    # Two more refreshes, so an error in the polling loop would show too.
    seen = renders(browser)
    WebDriverWait(browser, 10).until(lambda d: renders(d) >= seen + 2)

    png = artifacts() / "dashboard.png"
    png.write_bytes(full_page_png(browser))
    with capsys.disabled():
        print(f"\ndashboard screenshot: {png}")

    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert not errors, f"console errors: {errors}"
