"""The chat page of ``tessera serve`` in a real headless browser (Debian's
chromium + chromium-driver, driven by Selenium): two turns of a conversation
streamed into the page, the placement panel filled from the server, and a
screenshot saved under the test's tmp dir."""
from __future__ import annotations

import shutil

import pytest

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support import expected_conditions as EC  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from tessera_actors.serving.testing import ServerProcess  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER),
                                reason="needs Debian's chromium and chromium-driver "
                                       "(apt-get install -y chromium chromium-driver)")

SERVE_ARGS = ["--model", "smollm2", "--size", "tiny", "--devices", "cpu,cpu", "--max-model-len", "512"]


@pytest.fixture(scope="module")
def server():
    with ServerProcess(*SERVE_ARGS) as srv:
        yield srv


@pytest.fixture()
def browser(tmp_path):
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,800", f"--user-data-dir={tmp_path / 'profile'}"):
        opts.add_argument(arg)
    drv = webdriver.Chrome(service=Service(DRIVER), options=opts)
    drv.set_page_load_timeout(60)
    try:
        yield drv
    finally:
        drv.quit()


def ask(drv, question: str, turn: int) -> str:
    """Type a question, send it with Enter, wait until reply number ``turn`` has streamed in."""
    box = drv.find_element(By.ID, "prompt")
    box.send_keys(question)
    box.send_keys(Keys.ENTER)
    done = f"#messages .msg[data-done='true']:nth-of-type({2 * turn})"
    WebDriverWait(drv, 180).until(EC.presence_of_element_located((By.CSS_SELECTOR, done)))
    reply = drv.find_elements(By.CSS_SELECTOR, "#messages .msg")[2 * turn - 1]
    assert "error" not in reply.get_attribute("class"), reply.text
    return reply.text


def test_chat_page_streams_a_conversation(server, browser, tmp_path):
    browser.get(server.url + "/")
    assert browser.title == "tessera serve"
    WebDriverWait(browser, 60).until(lambda d: d.find_element(By.ID, "model").text == "smollm2")
    limit = browser.find_element(By.ID, "max-tokens")
    limit.clear()
    limit.send_keys("24")                                     # short replies: CI's CPU is slow
    first = ask(browser, "What is the capital of France?", 1)
    assert "tokens" in first and "finish:" in first          # the reply and its meta line
    second = ask(browser, "And of Italy?", 2)
    assert second
    history = browser.execute_script("return state.history")
    assert [m["role"] for m in history] == ["user", "assistant", "user", "assistant"]
    assert history[2]["content"] == "And of Italy?"
    # the placement panel: two devices with their kernels, bytes moved per step, live tok/s
    # the panel is redrawn every second: read it in one script call, not element by element
    read_rows = "return [...document.querySelectorAll('#placement tbody tr')].map(r => r.cells[1].textContent)"
    kernels = WebDriverWait(browser, 30).until(lambda d: (lambda k: k if len(k) == 2 else None)(d.execute_script(read_rows)))
    assert sum(int(k) for k in kernels) > 0
    assert browser.find_element(By.ID, "bytes").text != "-"
    assert float(browser.find_element(By.ID, "tps").text) > 0
    shot = tmp_path / "chat.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")


def test_the_page_of_a_server_with_an_api_key_asks_for_it_then_chats(browser):
    """A server started with --api-key: the page says it needs the key (not
    "connecting..."), the empty chat shows its hint, the favicon is served;
    once the key is entered the model appears and a reply streams."""
    with ServerProcess(*SERVE_ARGS, "--max-seqs", "1", "--api-key", "sesame") as srv:
        browser.get(srv.url + "/")
        WebDriverWait(browser, 60).until(lambda d: d.find_element(By.ID, "model").text == "API key needed")
        assert browser.find_element(By.ID, "key-row").is_displayed()
        assert browser.find_element(By.ID, "health").text == "locked"
        hint = browser.execute_script(
            "return getComputedStyle(document.getElementById('messages'), '::before').content")
        assert "Type a message" in hint
        key = browser.find_element(By.ID, "api-key")
        key.send_keys("sesame")
        key.send_keys(Keys.ENTER)
        WebDriverWait(browser, 60).until(lambda d: d.find_element(By.ID, "model").text == "smollm2")
        WebDriverWait(browser, 60).until(lambda d: d.find_element(By.ID, "health").text == "healthy")
        assert not browser.find_element(By.ID, "key-row").is_displayed()
        assert ask(browser, "Hi!", 1)
        icon = browser.execute_script("return fetch('/favicon.ico').then(r => r.status + ' ' + "
                                      "r.headers.get('content-type'))")
        assert icon == "200 image/svg+xml"
