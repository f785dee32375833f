"""The chat page at / of optiml serve, in a real browser: Debian's headless Chromium driven by selenium types a
question, and the answer streams in from the server's own API.

Oracle: optiml.Model.chat run alone, greedy, on the same conversation (the engine's own tests hold it to
transformers and llama.cpp), and the server's /metrics for what the page asked of it.
"""

import shutil
import time

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("sse_starlette")
webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

import optiml  # noqa: E402
from conftest import _missing, live_server  # noqa: E402

KEY = "sk-page-key"
N_CTX = 512
QUESTION = "What is the capital of France?"
SYSTEM = "Answer in one short sentence."


def _browser_paths():
    chrome = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver = shutil.which("chromedriver")
    if not chrome or not driver:
        _missing("headless Chromium and chromedriver", "apt-get install chromium chromium-driver (.ci/run does)")
    return chrome, driver


@pytest.fixture(scope="module")
def server(smollm2_path):
    from optiml.server import Server

    model = optiml.Model(smollm2_path, n_ctx=N_CTX, n_seq=2)
    srv = Server(model, n_parallel=2, api_key=KEY, model_id="smollm2", chunk=32)
    with live_server(srv):
        yield srv


@pytest.fixture(scope="module")
def browser():
    chrome, driver = _browser_paths()
    opts = Options()
    opts.binary_location = chrome
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1200,900"):
        opts.add_argument(a)
    b = webdriver.Chrome(service=Service(driver), options=opts)
    yield b
    b.quit()


def set_field(browser, name, value):
    el = browser.find_element(By.ID, name)
    el.clear()
    el.send_keys(str(value))
    el.send_keys(Keys.TAB)  # "change": the page keeps the setting


def open_page(browser, server):
    browser.get(server.url + "/")
    assert browser.title == "OptiML chat"


def wait_status(browser, pred, what, timeout=120):
    until(browser, timeout, lambda b: pred(b.find_element(By.ID, "status").text), what)
    return browser.find_element(By.ID, "status").text


def until(browser, timeout, pred, what=""):
    """Waits for pred(browser); an element the page re-rendered while it was being read (a bubble that a
    streamed message replaced) is a retry, not a failure."""
    return WebDriverWait(browser, timeout, ignored_exceptions=(StaleElementReferenceException,)).until(pred, what)


def bubbles(browser):
    return [(e.get_attribute("class").split()[-1], e.find_element(By.CLASS_NAME, "content").text)
            for e in browser.find_elements(By.CSS_SELECTOR, "#log .msg")]


def ask(browser, text):
    box = browser.find_element(By.ID, "prompt")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def test_page_streams_the_greedy_answer_and_keeps_the_conversation(server, browser, smollm2_path):
    open_page(browser, server)
    browser.execute_script("window.localStorage.clear()")
    browser.refresh()
    set_field(browser, "api_key", KEY)
    browser.refresh()  # the key is kept: the model list is read with it
    until(browser, 30, lambda b: "smollm2" in b.find_element(By.ID, "model").text)
    set_field(browser, "system", SYSTEM)
    set_field(browser, "temperature", 0)
    set_field(browser, "max_tokens", 24)

    ask(browser, QUESTION)
    status = wait_status(browser, lambda s: "pieces" in s, "the answer to finish")
    assert int(status.split()[0]) > 1, status  # it streamed: more than one piece arrived
    shown = bubbles(browser)
    assert [r for r, _ in shown] == ["user", "assistant"] and shown[0][1] == QUESTION

    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    with optiml.Model(smollm2_path, n_ctx=N_CTX) as m:
        expected = m.chat(msgs, temperature=0, max_tokens=24)
    assert shown[1][1] == expected.strip() or shown[1][1] == expected  # (innerText trims a trailing newline)
    assert "Paris" in shown[1][1]

    browser.refresh()  # the conversation is kept in the browser
    until(browser, 10, lambda b: len(bubbles(b)) == 2)
    assert bubbles(browser) == shown

    browser.find_element(By.ID, "clear").click()
    assert bubbles(browser) == []


def test_stop_ends_the_answer(server, browser):
    """Stop ends a running answer and keeps what came. A sampled answer may end on its own before Stop is
    clicked (an end-of-text token within 400): then the question is asked again, up to three times."""
    open_page(browser, server)
    set_field(browser, "api_key", KEY)
    set_field(browser, "temperature", 0.8)
    set_field(browser, "max_tokens", 400)
    for _ in range(3):
        browser.find_element(By.ID, "clear").click()
        ask(browser, "Write a long story about a lighthouse keeper.")
        until(browser, 60, lambda b: len(bubbles(b)) == 2 and len(bubbles(b)[1][1]) > 20)
        browser.find_element(By.ID, "stop").click()
        status = wait_status(browser, lambda s: s == "stopped" or " pieces in " in s, "the stop")
        if status == "stopped":
            break
    assert status == "stopped", status
    kept = bubbles(browser)[1][1]
    time.sleep(1.0)
    assert bubbles(browser)[1][1] == kept  # nothing more arrives
    assert browser.find_element(By.ID, "send").is_enabled()


def test_a_failed_turn_is_taken_back_and_the_right_key_works_without_a_reload(server, browser):
    """A request the server refuses leaves nothing in the conversation (the message returns to the box, so the
    next send is not refused for it again), and a page opened with a wrong key works once the key is right."""
    open_page(browser, server)
    set_field(browser, "api_key", "sk-wrong")
    browser.refresh()  # (opened with the wrong key: the model list was refused)
    until(browser, 30, lambda b: "not connected" in b.find_element(By.ID, "model").text)
    browser.find_element(By.ID, "clear").click()
    set_field(browser, "temperature", 0)
    set_field(browser, "max_tokens", 8)
    ask(browser, "Hello")
    until(browser, 30, lambda b: any(r == "error" for r, _ in bubbles(b)))
    err = [t for r, t in bubbles(browser) if r == "error"][0]
    assert "key" in err.lower(), err
    assert [r for r, _ in bubbles(browser)] == ["error"]
    assert browser.find_element(By.ID, "prompt").get_attribute("value") == "Hello"
    assert browser.execute_script("return localStorage.getItem('optiml.messages')") == "[]"

    set_field(browser, "api_key", KEY)
    until(browser, 30, lambda b: "smollm2" in b.find_element(By.ID, "model").text)
    browser.find_element(By.ID, "prompt").send_keys(Keys.ENTER)
    wait_status(browser, lambda s: "pieces" in s, "the answer")
    assert [r for r, _ in bubbles(browser)] == ["user", "assistant"]
    assert bubbles(browser)[0][1] == "Hello"


def test_turns_that_outgrow_the_context_are_left_out(server, browser):
    """Two messages of ~300 tokens each do not fit a context of 512 together: the server refuses the second
    request (context_length_exceeded), and the page asks again without the oldest turn, greyed on the page."""
    open_page(browser, server)
    set_field(browser, "api_key", KEY)
    browser.find_element(By.ID, "clear").click()
    set_field(browser, "temperature", 0)
    set_field(browser, "max_tokens", 4)
    long_text = "word " * 300
    for i in range(2):
        browser.execute_script("document.getElementById('prompt').value = arguments[0]", f"{i}: {long_text}")
        browser.find_element(By.ID, "send").click()
        until(browser, 120, lambda b: len(bubbles(b)) == 2 * (i + 1) and "pieces" in b.find_element(By.ID, "status").text)
    status = browser.find_element(By.ID, "status").text
    assert "no longer fit the context" in status, status
    classes = [e.get_attribute("class") for e in browser.find_elements(By.CSS_SELECTOR, "#log .msg")]
    assert ["dropped" in c for c in classes] == [True, True, False, False], classes
    assert browser.execute_script("return localStorage.getItem('optiml.first')") == "2"


def test_a_new_conversation_stops_the_running_answer(server, browser):
    open_page(browser, server)
    set_field(browser, "api_key", KEY)
    browser.find_element(By.ID, "clear").click()
    set_field(browser, "temperature", 0.8)
    set_field(browser, "max_tokens", 400)
    ask(browser, "Write a long story about a lighthouse keeper.")
    until(browser, 60, lambda b: len(bubbles(b)) == 2 and len(bubbles(b)[1][1]) > 20)
    browser.find_element(By.ID, "clear").click()
    assert bubbles(browser) == []
    assert browser.find_element(By.ID, "send").is_enabled()
    time.sleep(1.0)
    assert bubbles(browser) == []  # nothing of the old answer arrives in the new conversation
    assert browser.execute_script("return localStorage.getItem('optiml.messages')") == "[]"


def test_saved_conversations_render_safely(server, browser):
    """What the browser kept is checked (a broken value is a new conversation, not a broken page), and an
    answer's code blocks are shown as code while its HTML stays text."""
    open_page(browser, server)
    browser.execute_script("localStorage.setItem('optiml.messages', '{broken')")
    browser.refresh()
    assert bubbles(browser) == []
    until(browser, 30, lambda b: "not connected" in b.find_element(By.ID, "model").text
          or "smollm2" in b.find_element(By.ID, "model").text)

    answer = "Run this:\n```python\nprint('<b>hi</b>')\n```\nand **done** <img src=x onerror=alert(1)>"
    browser.execute_script("localStorage.setItem('optiml.messages', JSON.stringify(arguments[0]))",
                           [{"role": "user", "content": "<i>code?</i>"}, {"role": "assistant", "content": answer}])
    browser.refresh()
    until(browser, 10, lambda b: len(bubbles(b)) == 2)
    assert bubbles(browser)[0][1] == "<i>code?</i>"
    code = browser.find_elements(By.CSS_SELECTOR, "#log .assistant pre code")
    assert [c.text for c in code] == ["print('<b>hi</b>')"]
    assert browser.find_elements(By.CSS_SELECTOR, "#log img, #log b, #log i") == []
    assert browser.find_element(By.CSS_SELECTOR, "#log .assistant strong").text == "done"
    browser.execute_script("localStorage.clear()")


def test_a_failed_regenerate_or_oversized_turn_keeps_the_conversation(server, browser):
    """A regenerate that fails puts back the answer it was to replace; a message that fits the context with
    no earlier turn at all is taken back without leaving the earlier turns out of later requests."""
    kept = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"}]
    open_page(browser, server)
    browser.execute_script("localStorage.clear(); localStorage.setItem('optiml.messages', JSON.stringify(arguments[0]))",
                           kept)
    browser.refresh()
    set_field(browser, "api_key", "sk-wrong")
    until(browser, 10, lambda b: len(bubbles(b)) == 2)
    browser.find_element(By.XPATH, "//button[text()='regenerate']").click()
    until(browser, 30, lambda b: any(r == "error" for r, _ in bubbles(b)))
    assert [(r, t) for r, t in bubbles(browser) if r != "error"] == [("user", "Hi"), ("assistant", kept[1]["content"])]
    assert "previous answer is kept" in [t for r, t in bubbles(browser) if r == "error"][0]

    set_field(browser, "api_key", KEY)
    browser.execute_script("document.getElementById('prompt').value = arguments[0]", "word " * 700)
    browser.find_element(By.ID, "send").click()
    until(browser, 60, lambda b: any(r == "error" for r, _ in bubbles(b)))
    assert [r for r, _ in bubbles(browser) if r != "error"] == ["user", "assistant"]
    assert browser.execute_script("return localStorage.getItem('optiml.first')") == "0"
    assert browser.execute_script("return JSON.parse(localStorage.getItem('optiml.messages'))") == kept
    browser.execute_script("localStorage.clear()")


def test_reasoning_is_shown_apart_and_kept(browser):
    """A model that thinks in <think> tags (a stub replaying Qwen3-style text, tags cut between pieces): the
    page shows its reasoning_content in a folded box above the answer, as text, and keeps it across a reload."""
    from test_server_harmony import ANALYSIS, FINAL, StubServer

    with live_server(StubServer("think")) as srv:
        open_page(browser, srv)
        browser.execute_script("window.localStorage.clear()")
        browser.refresh()
        ask(browser, "Hi")
        wait_status(browser, lambda s: "pieces" in s, "the answer to finish")
        assert bubbles(browser)[1][1] == FINAL

        def reasoning(b):
            return b.execute_script("const d = document.querySelector('#log .assistant details.reasoning');"
                                    "return d ? [d.open, d.querySelector('div').textContent] : null;")
        assert reasoning(browser) == [False, ANALYSIS]  # folded once the answer began
        browser.refresh()
        until(browser, 10, lambda b: len(bubbles(b)) == 2)
        assert reasoning(browser) == [False, ANALYSIS] and bubbles(browser)[1][1] == FINAL
