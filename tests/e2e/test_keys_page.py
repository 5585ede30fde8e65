"""The keys page in a real browser: Debian's headless Chromium opens `/dashboard/keys` of a real
`onedoor demo`, creates a key (its secret shown once, copyable), and the key answers at the
client port; the page disables it (401), enables it again, and rotates it without a grace (the
old secret 401, the new one 200); no console error on the way.

A full-page screenshot is saved to $ONEDOOR_ARTIFACTS/keys.png (default
target/e2e-artifacts/keys.png in the repository).
"""

from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from test_dashboard import artifacts, browser, dashboard_link, full_page_png, request  # noqa: F401

CHAT = {"model": "chat-default", "max_tokens": 8, "messages": [{"role": "user", "content": "Hello"}]}


def chat_status(demo, key: str) -> int:
    return request(f"{demo.url}/v1/chat/completions", {"authorization": f"Bearer {key}"}, CHAT)[0]


def in_row(driver, key_id: str, read):
    """`read` of the key's row, or None while it is missing or being redrawn (the list refreshes
    itself every few seconds and after each action)."""
    try:
        rows = driver.find_elements(By.CSS_SELECTOR, f'#keys tr[data-key="{key_id}"]')
        return read(rows[0]) if rows else None
    except StaleElementReferenceException:
        return None


def row_state(driver, key_id: str) -> str:
    return in_row(driver, key_id, lambda row: row.get_attribute("data-state")) or ""


def click_in_row(driver, key_id: str, action: str) -> None:
    def click(row):
        row.find_element(By.CSS_SELECTOR, f'button[data-action="{action}"]').click()
        return True

    WebDriverWait(driver, 10).until(lambda d: in_row(d, key_id, click))


def shown_secret(driver, previous: str = "") -> tuple[str, str]:
    WebDriverWait(driver, 10).until(
        lambda d: d.find_element(By.ID, "secret").is_displayed()
        and d.find_element(By.ID, "secret-value").text not in ("", previous)
    )
    panel = driver.find_element(By.ID, "secret")
    return panel.get_attribute("data-key-id"), driver.find_element(By.ID, "secret-value").text


def test_the_keys_page_creates_disables_and_rotates_a_key_that_works_at_once(own_demo, browser, capsys):
    admin, token = dashboard_link(own_demo)
    browser.get(f"{admin}/dashboard/keys#token={token}")
    WebDriverWait(browser, 15).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#create-tenant option"))
    assert "#token" not in browser.current_url, "the token stays out of the address bar"

    browser.find_element(By.ID, "create-name").send_keys("browser-app")
    browser.find_element(By.ID, "create-rpm").send_keys("30")
    browser.find_element(By.ID, "create-submit").click()
    key_id, secret = shown_secret(browser)
    assert secret.startswith("od-") and len(secret) == 43, secret
    browser.find_element(By.ID, "secret-copy").click()
    WebDriverWait(browser, 5).until(lambda d: d.find_element(By.ID, "secret-copy").text == "Copied")
    WebDriverWait(browser, 10).until(lambda d: row_state(d, key_id) == "active")
    row = WebDriverWait(browser, 10).until(lambda d: in_row(d, key_id, lambda r: r.text))
    assert "browser-app" in row and "rpm 30" in row, row
    assert secret not in row
    assert chat_status(own_demo, secret) == 200

    click_in_row(browser, key_id, "disable")
    WebDriverWait(browser, 10).until(lambda d: row_state(d, key_id) == "disabled")
    assert chat_status(own_demo, secret) == 401
    click_in_row(browser, key_id, "enable")
    WebDriverWait(browser, 10).until(lambda d: row_state(d, key_id) == "active")
    assert chat_status(own_demo, secret) == 200

    Select(browser.find_element(By.ID, "grace")).select_by_value("0s")
    click_in_row(browser, key_id, "rotate")
    rotated_id, fresh = shown_secret(browser, previous=secret)
    assert rotated_id == key_id and fresh != secret
    assert chat_status(own_demo, secret) == 401
    assert chat_status(own_demo, fresh) == 200

    # A refusal is shown on the page, not in the console.
    browser.find_element(By.ID, "create-expires").send_keys("2020-01-01T00:00:00Z")
    browser.find_element(By.ID, "create-submit").click()
    WebDriverWait(browser, 10).until(lambda d: d.find_element(By.ID, "problem").is_displayed())
    assert "is in the past" in browser.find_element(By.ID, "problem").text

    png = artifacts() / "keys.png"
    png.write_bytes(full_page_png(browser))
    with capsys.disabled():
        print(f"\nkeys page screenshot: {png}")

    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    # The refused create above is an HTTP 400, which Chromium logs as a failed resource load.
    errors = [e for e in errors if "status of 400" not in e["message"]]
    assert not errors, f"console errors: {errors}"
