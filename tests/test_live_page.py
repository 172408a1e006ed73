"""The live page (`GET /` on the HTTP door) in a real headless Chromium, driven by selenium
through the distribution's chromedriver (`make test` installs both: scripts/install-browser.sh).

One 3-rank cluster of a scripted tiny llama with a bearer token: the page asks for the
token, draws every rank with its layer range, streams a chat answer, shows a request in
flight, a stopped worker as slow (and normal again once it goes on) and a killed worker as
gone, with the reason the cluster gave, within seconds, and then, once rank 0 has exited,
its last known state marked as such. Screenshots go to
the test's folder (and to $MLX_RELAY_LIVE_SHOTS when set).
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import start_cluster, stop_cluster
from mlx_lm.utils import load_tokenizer
from scripted import script_model
from tiny_models import make_tiny_model

from mlx_relay.coordinator.requests import encode_text
from mlx_relay.launch.local import free_ports
from mlx_relay.protocol.exits import EXIT_CLUSTER_FAILED

pytestmark = pytest.mark.cluster

TOKEN = "live-page-token"
ANSWER = "Hello from the ring!"
CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")
DRIVER = ("/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver")


def _first(paths: tuple[str, ...], name: str) -> str | None:
    return next((p for p in paths if os.access(p, os.X_OK)), None) or shutil.which(name)


def _browser():
    """A headless Chromium under selenium, or a skip saying what is missing."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("selenium is not installed (pip install -e '.[dev]')")
        pytest.skip("selenium is not installed (pip install -e '.[dev]')")
    chromium, driver = _first(CHROMIUM, "chromium"), _first(DRIVER, "chromedriver")
    if not chromium or not driver:
        why = (
            "no headless browser: chromium and chromedriver are missing and could not be "
            "installed here (as root with apt-get: `make browser`, scripts/install-browser.sh)"
        )
        if os.environ.get("CI") == "true":  # (in CI the browser test runs, or fails)
            pytest.fail(why)
        pytest.skip(why)
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    options.add_argument("--window-size=1400,1500")
    return webdriver.Chrome(options=options, service=Service(executable_path=driver))


# Each rank's box as values, read in one go (the page may redraw between two calls).
RANK_BOXES = """return Array.from(document.querySelectorAll('.rank')).map(b => {
    const l = b.querySelector('.layers');
    return {rank: b.dataset.rank, status: b.dataset.status, text: b.innerText,
            layers: l && l.dataset.layers, layers_text: l ? l.innerText : ''};
})"""


def _wait(what: str, check, timeout: float, browser=None):
    deadline = time.monotonic() + timeout
    while True:
        try:
            found = check()
        except Exception:  # noqa: BLE001 - the DOM changes under us: look again
            found = None
        if found:
            return found
        if time.monotonic() > deadline:
            log = ""
            if browser is not None:
                log = browser.find_element("tag name", "body").text[:3000]
            raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{log}")
        time.sleep(0.1)


def _shot(browser, directory: Path, name: str) -> Path:
    path = directory / f"{name}.png"
    browser.execute_script("window.scrollTo(0, 0)")
    browser.save_screenshot(str(path))
    assert path.stat().st_size > 10_000, "an empty screenshot"
    extra = os.environ.get("MLX_RELAY_LIVE_SHOTS")
    if extra:
        Path(extra).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(extra) / path.name)
    return path


@pytest.fixture
def scripted(tmp_path):
    """A tiny llama that answers any chat with ANSWER; any other last token is followed
    by token 0 for ever (a long-running request)."""
    path = make_tiny_model(tmp_path / "model", "llama", num_layers=6)
    tokenizer = load_tokenizer(path)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    script_model(path, {encode_text(tokenizer, chat)[-1]: [ANSWER]})
    return path


def test_live_page_in_a_browser(scripted, tmp_path):
    browser = _browser()
    port = free_ports(1)[0]
    base = f"http://127.0.0.1:{port}"
    running = start_cluster(
        scripted,
        3,
        tmp_path / "logs",
        "--http-address",
        f"127.0.0.1:{port}",
        "--heartbeat-timeout",
        "4",  # (rank 2 is stopped for a second or two below, and must not count as gone)
        auth_token=TOKEN,
    )
    auth = {"Authorization": f"Bearer {TOKEN}"}
    background = threading.Thread(target=_long_request, args=(base, auth), daemon=True)
    try:
        # The page is open (so it can ask for the token); what it reads is not.
        with httpx.Client(base_url=base, timeout=30) as http:
            page = http.get("/", headers={"Accept": "text/html"})
            assert page.status_code == 200 and "<title>mlx-relay" in page.text
            assert "http://" not in page.text.replace(base, "") and "https://" not in page.text
            assert http.get("/v1/status/stream").status_code == 401
            assert http.get("/v1/status").status_code == 401
            assert http.get("/", headers=auth).text.startswith("mlx-relay is running")
            status = http.get("/v1/status", headers=auth).json()
        ranges = {r["rank"]: (r["layer_start"], r["layer_end"]) for r in status["ranks"]}
        assert sorted(ranges) == [0, 1, 2] and status["hop_mode"]

        browser.get(base + "/")
        # The token, asked for once and kept for the tab.
        token_box = _wait(
            "the token prompt",
            lambda: (
                browser.find_element("id", "auth-token").is_displayed()
                and browser.find_element("id", "auth-token")
            ),
            15,
        )
        token_box.send_keys(TOKEN + "\n")
        assert browser.execute_script("return sessionStorage.getItem('mlx-relay-token')") == TOKEN

        # The ring: every rank with its layer range, as /v1/status says. (The boxes are
        # read in one script, as values: the page redraws them on every update, and a
        # box kept from one call to the next may be gone: a stale element.)
        def drawn():
            boxes = browser.execute_script(RANK_BOXES)
            return boxes if len(boxes) == 3 else None

        boxes = _wait("three ranks drawn", drawn, 15, browser)
        for box in boxes:
            start, end = ranges[int(box["rank"])]
            assert box["layers"] == f"{start}-{end}"
            assert f"layers {start}–{end}" in box["layers_text"]
            assert box["status"] == "ok", box["text"]
        # Asked once: a reload keeps the token (sessionStorage) and draws the ring again.
        browser.refresh()
        boxes = _wait("three ranks drawn after a reload", drawn, 15, browser)
        assert not browser.find_element("id", "auth-token").is_displayed()
        facts = browser.find_element("id", "facts").text
        assert status["hop_mode"] in facts and str(status["num_layers"]) in facts
        assert not browser.find_element("id", "f-draft").is_displayed()  # none yet

        # A chat answered, streamed into the page.
        browser.find_element("id", "chat-input").send_keys("Hi")
        browser.find_element("id", "chat-send").click()
        answer = _wait(
            "the streamed answer",
            lambda: browser.find_element("css selector", ".msg.assistant[data-state=done]"),
            30,
            browser,
        )
        assert answer.find_element("css selector", ".text").text == ANSWER
        assert "finish: stop" in answer.text

        # A request in flight, with its phase and tokens, and the throughput it makes.
        background.start()
        _wait(
            "a request in flight with tokens",
            lambda: any(
                row.find_elements("css selector", "td")[1].text == "decode"
                and int(row.find_elements("css selector", "td")[4].text) > 0
                for row in browser.find_elements("css selector", "#requests tr[data-request]")
            ),
            20,
            browser,
        )
        _wait(
            "throughput drawn",
            lambda: browser.find_elements("css selector", "#chart-decode svg polyline"),
            10,
            browser,
        )
        time.sleep(1.5)  # a little more of the chart
        _shot(browser, tmp_path, "live-serving")

        # Stop rank 2 (SIGSTOP) mid-stream: slow, with the step it holds, until it goes on.
        stopped = running.cluster.procs[2]
        os.kill(stopped.pid, signal.SIGSTOP)
        try:
            slow = _wait(
                "rank 2 shown as slow",
                lambda: (
                    (box := browser.find_element("id", "rank-2")).get_attribute("data-status")
                    == "slow"
                    and box.text
                ),
                3,
                browser,
            )
            assert "slow: step" in slow and "has not passed the step on" in slow, slow
            _shot(browser, tmp_path, "live-slow")
        finally:
            stopped.send_signal(signal.SIGCONT)  # (none if it has exited)
        _wait(
            "rank 2 back to normal",
            lambda: browser.find_element("id", "rank-2").get_attribute("data-status") == "ok",
            5,
            browser,
        )

        # Kill rank 1: shown as gone, with the cluster's reason, within a few seconds.
        killed = time.monotonic()
        running.cluster.procs[1].kill()
        # (each check returns the element's text, read while it is current: the page
        # redraws the boxes every update, and an element kept past one goes stale)
        gone = _wait(
            "rank 1 shown as gone",
            lambda: (
                (box := browser.find_element("id", "rank-1")).get_attribute("data-status") == "gone"
                and box.text
            ),
            8,
            browser,
        )
        shown = time.monotonic() - killed
        assert "rank 1" in gone or "gone" in gone, gone
        # The banner says "cannot serve" the moment a rank is down and "failed" once the
        # cluster has given up: wait for the second, the state the page ends in.
        _wait(
            "the failure banner naming rank 1",
            lambda: (
                (b := browser.find_element("id", "banner")).is_displayed()
                and "rank 1" in (text := b.text)
                and "failed" in text
            ),
            8,
            browser,
        )
        # Rank 0 exits (3) after a cluster failure: the page keeps the last state and says so.
        assert running.cluster.procs[0].wait(15) == EXIT_CLUSTER_FAILED
        _wait(
            "the page to say rank 0 stopped answering",
            lambda: (
                "disconnected" in browser.find_element("id", "conn").text
                and "stopped answering" in browser.find_element("id", "banner").text
            ),
            10,
            browser,
        )
        box = browser.find_element("id", "rank-1")
        assert box.get_attribute("data-status") == "gone" and "rank 1" in box.text
        _shot(browser, tmp_path, "live-failed")
        print(f"\nkill -9 of rank 1 -> shown as gone on the page in {shown:.2f} s")
    finally:
        browser.quit()
        stop_cluster(running)


def _long_request(base: str, auth: dict[str, str]) -> None:
    """A raw completion that runs until the cluster fails (or 1,500 tokens)."""
    body = {"prompt": "Once upon a time", "max_tokens": 1500, "stream": True}
    try:
        with httpx.stream(
            "POST", base + "/v1/completions", json=body, headers=auth, timeout=60
        ) as r:
            for _ in r.iter_lines():
                pass
    except httpx.HTTPError:
        pass  # the cluster failed under it, as it should
