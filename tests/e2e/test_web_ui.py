"""The web page at `/` in a real browser: headless Chromium driven by selenium (chromedriver, the
WebDriver protocol) against the real server with an API key. The page asks for the key, streams a
reply, stops one, and the dashboard shows the models, the memory budget bars and the live counters; over a
fake model with a batch folder, its Batches panel follows a batch to completed and cancels a running one.

Screenshots are written under the test's tmp_path (printed; `pytest -s` shows the path). The browser tests
skip without Chromium and its driver (`apt-get install chromium chromium-driver`; .ci/run installs them).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import json
import os
import time
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from mlxhost.config import EngineConfig, SecurityConfig, ServerConfig
from mlxhost.server.app import build_app
from mlxhost.testing.needs import need

SERVED_NAME = "tiny"  # the name tests/e2e/conftest.py serves under
KEY = "sk-web-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
WAIT_S = 120  # a bound for each wait, not a timing check
IN_CHROMIUM = pytest.mark.needs("chromium", "chromedriver")  # checked before the server starts


def web_config(model_dir, **kw) -> ServerConfig:
    return ServerConfig(model=str(model_dir), served_model_name=SERVED_NAME, engine=EngineConfig(max_num_seqs=4),
                        security=SecurityConfig(api_keys=(KEY,)), **kw)


def test_page_files_and_no_web_ui(qwen3_model_dir):
    # No lifespan (no `with`): nothing here reaches an engine.
    on = TestClient(build_app(web_config(qwen3_model_dir)), base_url="http://127.0.0.1")
    page = on.get("/")  # the files hold no data: they load without the key; the API does not
    assert page.status_code == 200 and "Content-Security-Policy" in page.headers
    assert 'src="/static/app.js"' in page.text
    assert on.get("/static/app.js").status_code == 200 and on.get("/static/style.css").status_code == 200
    assert on.get("/v1/models").status_code == 401
    off = TestClient(build_app(web_config(qwen3_model_dir, web_ui=False)), base_url="http://127.0.0.1")
    assert off.get("/").status_code == 401  # no page: `/` is an ordinary closed path again
    assert off.get("/", headers=AUTH).status_code == 404


@pytest.fixture(scope="module")
def live(qwen3_model_dir, serve_module_app):
    return serve_module_app(build_app(web_config(qwen3_model_dir)))


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    chromium, driver_path = need("chromium"), need("chromedriver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,860", "--disable-extensions", "--no-first-run",
                f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        options.add_argument(arg)
    # Chromium dies at start with a preloaded library (.ci/run preloads OpenBLAS for MLX): not for the browser.
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    driver = webdriver.Chrome(service=Service(executable_path=driver_path, env=env), options=options)
    yield driver
    driver.quit()


def num_running(live) -> float:
    text = httpx.get(live.url + "/metrics", headers=AUTH, timeout=30).text
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith("mlxhost_num_requests_running ")))


def wait_for(driver, condition, message: str):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    # The dashboard redraws its tables every 2 s: an element found a moment ago may be gone; look again.
    wait = WebDriverWait(driver, WAIT_S, poll_frequency=0.1, ignored_exceptions=(StaleElementReferenceException,))
    return wait.until(lambda d: condition(d), message)


def click(driver, selector: str) -> None:
    """Clicks `selector`, finding it again if a redraw replaced it between the find and the click."""
    from selenium.webdriver.common.by import By

    def attempt(d) -> bool:
        d.find_element(By.CSS_SELECTOR, selector).click()
        return True

    wait_for(driver, attempt, f"could not click {selector}")


def text_of(driver, selector: str) -> str:
    from selenium.webdriver.common.by import By

    found = driver.find_elements(By.CSS_SELECTOR, selector)
    return found[-1].text if found else ""


@IN_CHROMIUM
def test_chat_and_dashboard_in_chromium(live, browser, tmp_path):
    from selenium.webdriver.common.by import By

    d = browser
    find = lambda sel: d.find_element(By.CSS_SELECTOR, sel)  # noqa: E731
    shots = []

    def shot(name: str) -> None:
        path = tmp_path / f"{name}.png"
        d.save_screenshot(str(path))
        shots.append(path)

    # The page loads without the key, and asks for it when the API answers 401.
    d.get(live.url + "/")
    wait_for(d, lambda _: "API key" in find("#notice").text, "the page never asked for the API key")
    find("#key").send_keys(KEY)
    find("#key-form button").click()
    wait_for(d, lambda _: SERVED_NAME in find("#model").text, "the model list never loaded with the key")
    assert d.execute_script("return localStorage.getItem('mlxhost.apiKey')") == KEY

    # A streamed reply: the reply's text changes several times before the stats line appears.
    find("#system").send_keys("You are terse.")
    find("#max-tokens").clear()
    find("#max-tokens").send_keys("24")
    # Greedy: at the page's default 0.7 the random model samples its end-of-sequence token within 24
    # tokens now and then (CI saw "5 tokens · stop"); greedy, this prompt runs to the length limit.
    find("#temperature").clear()
    find("#temperature").send_keys("0")
    d.execute_script("""window.numUpdates = 0;
        new MutationObserver(() => window.numUpdates++).observe(document.querySelector('#log'),
            {subtree: true, childList: true, characterData: true});""")
    find("#prompt").send_keys("Tell me a story")
    find("#send").click()
    wait_for(d, lambda _: "tok/s" in text_of(d, ".msg.assistant .stats"), "no stats line under the reply")
    assert text_of(d, ".msg.assistant .content").strip(), "the reply has no text"
    stats = text_of(d, ".msg.assistant .stats")
    assert "TTFT" in stats and "24 tokens" in stats and "length" in stats, stats
    assert d.execute_script("return window.numUpdates") > 3  # token by token, not one block at the end
    assert text_of(d, ".msg.user .content") == "Tell me a story"
    find("#temperature").clear()
    find("#temperature").send_keys("0.7")  # the rest of the test runs at the page's default
    shot("chat")

    # JSON mode (response_format json_object) and an attached image (a data: URI image_url part): this
    # fixture is a text model, so the image's 400 must reach the page as the reply's error.
    find("#json-mode").click()
    find("#prompt").send_keys("A JSON object, please")
    find("#send").click()
    wait_for(d, lambda _: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats")) == 2
             and "tokens" in text_of(d, ".msg.assistant .stats"), "no JSON-mode reply")
    assert text_of(d, ".msg.assistant .badge").startswith("JSON")
    find("#json-mode").click()
    image = tmp_path / "red.png"
    Image.new("RGB", (8, 8), (255, 0, 0)).save(image)
    find("#image").send_keys(str(image))
    wait_for(d, lambda _: find("#attachment").is_displayed(), "the attached image is not shown")
    find("#prompt").send_keys("What is this?")
    find("#send").click()
    wait_for(d, lambda _: text_of(d, ".msg.assistant .error"), "no error shown for an image to a text model")
    assert find(".msg.user .thumb").get_attribute("src").startswith("data:image/png;base64,")
    assert not find("#attachment").is_displayed()
    find("#clear").click()
    assert not d.find_elements(By.CSS_SELECTOR, "#log .msg")

    # Stop: the request is aborted, the server lets it go, and the page can send again.
    find("#max-tokens").clear()
    find("#max-tokens").send_keys("3000")
    find("#prompt").send_keys("Go on")
    find("#send").click()
    wait_for(d, lambda _: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")) == 1  # after New conversation
             and text_of(d, ".msg.assistant .content"), "the long reply never started")
    find("#stop").click()
    wait_for(d, lambda _: "stopped" in text_of(d, ".msg.assistant .stats"), "Stop did not end the reply")
    assert find("#send").is_enabled() and not find("#stop").is_enabled()
    wait_for(d, lambda _: num_running(live) == 0, "the server kept generating after Stop")

    # Dashboard: models with their state, one budget bar per loaded model, cache and live counters.
    find("#tab-dash").click()
    wait_for(d, lambda _: len(d.find_elements(By.CSS_SELECTOR, "#budgets .bar .seg")) == 6, "no budget bars")
    kv_width = d.execute_script("return document.querySelector('#budgets .seg.kv').getBoundingClientRect().width")
    assert kv_width > 0
    wait_for(d, lambda _: "KV cache" in find("#budgets .legend").text, "no KV cache in the budget legend")
    wait_for(d, lambda _: SERVED_NAME in (t := find("#models-table").text) and "loaded" in t, "model not listed")
    wait_for(d, lambda _: "prefix hit rate" in find("#caches").text, "no cache stats")
    wait_for(d, lambda _: "tokens generated" in find("#live").text and "running" in find("#live").text,
             "no live counters from /metrics")
    # No batch folder here: /v1/batches is no route (404), and the page shows no Batches panel.
    assert httpx.get(live.base_url + "/batches", headers=AUTH).status_code == 404
    assert not find("#batches").is_displayed()
    shot("dashboard")

    # Unload and load again through the buttons (POST /v1/models/NAME/unload and /load).
    click(d, "#models-table tbody button")
    wait_for(d, lambda _: "not loaded" in find("#models-table").text, "Unload did not unload the model")
    assert httpx.get(live.base_url + "/models", headers=AUTH).json()["data"][0][
        "status"] == "not_loaded"
    click(d, "#models-table tbody button")
    wait_for(d, lambda _: find("#models-table tbody button").text == "Unload", "Load did not load the model")
    wait_for(d, lambda _: len(d.find_elements(By.CSS_SELECTOR, "#budgets .bar")) == 1, "no bar after loading")

    # Script errors only: the 401 before the key was typed is logged as a failed resource load.
    errors = [e for e in d.get_log("browser") if e["level"] == "SEVERE" and "Failed to load resource" not in e["message"]]
    assert not errors, errors
    print("\nweb page screenshots:", *shots, sep="\n  ")


@IN_CHROMIUM
def test_docs_render_offline_in_chromium(qwen3_model_dir, serve_module_app, browser, tmp_path):
    """`/docs` draws Swagger UI's operations from the server's own files (this machine has no internet), and
    `/redoc` draws ReDoc's. No key is set here: the docs pages are behind it like the API."""
    from selenium.webdriver.common.by import By

    open_live = serve_module_app(build_app(ServerConfig(model=str(qwen3_model_dir), served_model_name=SERVED_NAME,
                                                        engine=EngineConfig(max_num_seqs=4))))
    browser.get(open_live.url + "/docs")
    wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".opblock-summary-path"), "Swagger UI drew nothing")
    paths = {e.text.replace("\u200b", "") for e in browser.find_elements(By.CSS_SELECTOR, ".opblock-summary-path")}
    assert {"/v1/chat/completions", "/v1/models/{model_id}"} <= paths, paths
    browser.save_screenshot(str(tmp_path / "docs.png"))
    browser.get(open_live.url + "/redoc")
    wait_for(browser, lambda d: "/v1/chat/completions" in d.find_element(By.TAG_NAME, "body").text,
             "ReDoc drew nothing")
    browser.save_screenshot(str(tmp_path / "redoc.png"))


@pytest.fixture(scope="module")
def mcp_live(serve_module_app):
    """The page over a scripted fake model (tests/mcp/conftest.py) and two MCP servers of tests/mcp: `slow`,
    and `gated`, the same program configured to ask for approval of every call."""
    from mlxhost.frontends.admin.web import add_web_routes
    from mlxhost.frontends.app import create_app
    from mlxhost.mcp.client import McpManager
    from mlxhost.mcp.config import McpConfig
    from tests.frontends.fake_models import FakeModels
    from tests.mcp.conftest import SLOW_SERVER, ScriptedEngine, tool_call

    models = FakeModels()
    models.engine = ScriptedEngine([
        tool_call("big", n=3), "The tool said xxx.",  # turn 1: a call and its output
        tool_call("sleep", seconds=60), "The tool timed out.",  # turn 2: a call that fails
        tool_call("pid"), "Approved, it ran.",  # turn 3: a call the config gates, approved on the page
        "No tools this time."])  # turn 4: every server off
    gated = dataclasses.replace(SLOW_SERVER, label="gated", require_approval="always")
    app = create_app(models, McpManager(McpConfig(servers=(SLOW_SERVER, gated), call_timeout_s=2)))
    add_web_routes(app)
    return serve_module_app(app), models


@IN_CHROMIUM
def test_chat_with_mcp_tools_in_chromium(mcp_live, browser, tmp_path):
    from selenium.webdriver.common.by import By

    live, models = mcp_live
    d = browser
    find = lambda sel: d.find_element(By.CSS_SELECTOR, sel)  # noqa: E731
    all_of = lambda sel: d.find_elements(By.CSS_SELECTOR, sel)  # noqa: E731
    d.get(live.url + "/")
    wait_for(d, lambda _: len(all_of("#mcp-servers input")) == 2, "no MCP server toggles")
    assert find("#mcp").is_displayed()
    assert "slow" in find("#mcp-servers").text and "asks approval" in find("#mcp-servers").text
    # The page's requests, recorded: with a server on, the chat goes through /v1/responses and its mcp tools.
    d.execute_script("""window.sent = []; const f = window.fetch;
        window.fetch = (url, opts) => { if (opts && opts.body) window.sent.push([url, JSON.parse(opts.body)]);
                                        return f(url, opts); };""")

    def turn(prompt: str, n: int) -> None:
        find("#prompt").send_keys(prompt)
        find("#send").click()
        wait_for(d, lambda _: len(all_of(".msg.assistant .stats")) == n and text_of(d, ".msg.assistant .stats"),
                 f"no reply to {prompt!r}")

    click(d, "#mcp-servers input[data-server='slow']")
    turn("Use big", 1)
    path, body = d.execute_script("return window.sent.at(-1)")
    assert path == "/v1/responses" and body["stream"] is True
    assert [t for t in body["tools"] if t["type"] == "mcp"] == [
        {"type": "mcp", "server_label": "slow", "require_approval": "never"}]
    assert text_of(d, ".msg.assistant .mcp-tool") == "slow · big"
    assert json.loads(text_of(d, ".msg.assistant .mcp-arguments")) == {"n": 3}
    assert text_of(d, ".msg.assistant .mcp-output") == "xxx"
    assert text_of(d, ".msg.assistant .content") == "The tool said xxx."
    assert "1 MCP call" in text_of(d, ".msg.assistant .stats")

    # A failing call shows its error; the conversation sent back holds the first turn's call.
    turn("Now sleep", 2)
    _, body = d.execute_script("return window.sent.at(-1)")
    [earlier] = [i for i in body["input"] if i.get("type") == "mcp_call"]
    assert (earlier["name"], earlier["output"]) == ("big", "xxx")
    last = all_of(".msg.assistant")[-1]
    assert "timed out after 2 s" in last.find_element(By.CSS_SELECTOR, ".mcp-call.failed .mcp-error").text
    assert last.find_element(By.CSS_SELECTOR, ".content").text == "The tool timed out."

    # A server whose config asks approval: the page shows the call with Approve, and approving runs it.
    click(d, "#mcp-servers input[data-server='slow']")
    click(d, "#mcp-servers input[data-server='gated']")
    turn("Your pid?", 3)
    assert "awaiting approval" in text_of(d, ".msg.assistant .stats")
    assert text_of(d, ".msg.assistant .approval .mcp-tool") == "gated · pid"
    click(d, ".msg.assistant .approval button[aria-label='Approve gated pid']")
    wait_for(d, lambda _: len(all_of(".msg.assistant .stats")) == 4 and text_of(d, ".msg.assistant .stats"),
             "approving did not continue the response")
    _, body = d.execute_script("return window.sent.at(-1)")
    assert body["previous_response_id"] and body["input"][0]["type"] == "mcp_approval_response"
    assert body["input"][0]["approve"] is True
    assert text_of(d, ".msg.assistant .mcp-tool") == "gated · pid"
    assert text_of(d, ".msg.assistant .mcp-output").isdigit()  # the server's process id
    assert text_of(d, ".msg.assistant .content") == "Approved, it ran."

    # Every server off: chat completions again, with no MCP fields in the messages.
    click(d, "#mcp-servers input[data-server='gated']")
    turn("Plain", 5)
    path, body = d.execute_script("return window.sent.at(-1)")
    assert path == "/v1/chat/completions" and not any("mcp" in m for m in body["messages"])
    assert text_of(d, ".msg.assistant .content") == "No tools this time."
    d.save_screenshot(str(tmp_path / "chat-mcp.png"))
    print("\nweb page screenshot:", tmp_path / "chat-mcp.png")
    # Script errors only (a missing favicon is logged as a failed resource load).
    errors = [e for e in d.get_log("browser") if e["level"] == "SEVERE" and "Failed to load resource" not in e["message"]]
    assert not errors, errors


@pytest.fixture(scope="module")
def batch_live(serve_module_app, tmp_path_factory):
    """The page over a fake model whose engine holds each request while `engine.holding` is set, with a batch
    folder and the API key: the page must send the key for its batch list."""
    from mlxhost.frontends.admin.web import add_web_routes
    from mlxhost.frontends.app import create_app
    from mlxhost.frontends.batch.routes import install_batch_api
    from mlxhost.frontends.common.security import install_security
    from tests.frontends.fake_models import NAME, FakeModels, InstantEngine

    class HoldingEngine(InstantEngine):
        holding = False  # set from the test's thread; read between the server loop's sleeps

        def generate(self, request):
            inner = super().generate(request)

            async def outputs():
                while self.holding:
                    await asyncio.sleep(0.02)
                async for out in inner:
                    yield out

            return outputs()

    class Models(FakeModels):
        def close(self, *_) -> None:  # the app's lifespan passes the shutdown deadline
            pass

        def cards(self) -> list[dict]:  # the dashboard's models table reads each model's state
            return [{"id": NAME, "object": "model", "status": "loaded"}]

        @contextlib.contextmanager
        def hold(self, name: str):  # /v1/status and /v1/cache/stats read the engine's snapshot
            yield SimpleNamespace(snapshot=SimpleNamespace(status={"model": NAME}, cache_stats={"enabled": False}))

    models = Models()
    models.engine = HoldingEngine()
    app = create_app(models)
    add_web_routes(app)
    install_batch_api(app, tmp_path_factory.mktemp("batches"))
    install_security(app, SecurityConfig(api_keys=(KEY,)), "127.0.0.1", web_page=True)
    return serve_module_app(app), models


def create_batch(live, bodies: list[dict]) -> str:
    text = "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": b})
                   + "\n" for i, b in enumerate(bodies))
    source = httpx.post(live.base_url + "/files", headers=AUTH, data={"purpose": "batch"},
                        files={"file": ("in.jsonl", io.BytesIO(text.encode()))}).json()
    made = httpx.post(live.base_url + "/batches", headers=AUTH, json={
        "input_file_id": source["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    assert made.status_code == 200, made.text
    return made.json()["id"]


def batch_status(live, batch_id: str) -> str:
    return httpx.get(f"{live.base_url}/batches/{batch_id}", headers=AUTH).json()["status"]


@IN_CHROMIUM
def test_dashboard_batches_in_chromium(batch_live, browser, tmp_path):
    from selenium.webdriver.common.by import By

    live, models = batch_live
    d = browser
    find = lambda sel: d.find_element(By.CSS_SELECTOR, sel)  # noqa: E731
    row = lambda batch_id: d.find_element(By.XPATH, f"//tbody/tr[td/code[text()='{batch_id}']]")  # noqa: E731
    d.get(live.url + "/")
    find("#key").clear()
    find("#key").send_keys(KEY)
    find("#key-form button").click()
    find("#tab-dash").click()
    wait_for(d, lambda _: SERVED_NAME in find("#models-table").text, "the dashboard never loaded")
    assert not find("#batches").is_displayed()  # a batch folder, but no batch yet

    # Two good lines and one the route refuses (400): the row reaches completed with 3 of 3 answered, 1 failed.
    line = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    done_id = create_batch(live, [line, line, {**line, "max_tokens": -1}])
    wait_for(d, lambda _: "completed" in row(done_id).text, "the batch's row never showed completed")
    cells = row(done_id).find_elements(By.TAG_NAME, "td")
    assert cells[1].text == "/v1/chat/completions"
    assert cells[3].text == "3 / 3 (1 failed)", cells[3].text
    bar = cells[3].find_element(By.CSS_SELECTOR, "[role=progressbar]")
    assert (bar.get_attribute("aria-valuenow"), bar.get_attribute("aria-valuemax")) == ("3", "3")
    assert d.execute_script("const b = arguments[0]; return b.firstChild.getBoundingClientRect().width"
                            " / b.getBoundingClientRect().width", bar) > 0.95
    # The created time, in the browser's locale: a year of this or an adjacent one (time zones at New Year).
    year = time.localtime().tm_year
    assert any(str(y) in cells[4].text for y in (year - 1, year, year + 1))
    assert not cells[5].find_elements(By.TAG_NAME, "button")  # an ended batch has no Cancel

    # A second batch held in the engine: Cancel on its row makes it cancelling (its lines in flight finish),
    # then cancelled once the engine lets them go.
    models.engine.holding = True
    try:
        held_id = create_batch(live, [line] * 4)
        wait_for(d, lambda _: "in progress" in row(held_id).text, "the second batch never showed in progress")
        d.save_screenshot(str(tmp_path / "batches.png"))
        click(d, f"#batches-table button[aria-label='Cancel {held_id}']")
        wait_for(d, lambda _: batch_status(live, held_id) in ("cancelling", "cancelled"), "Cancel sent nothing")
        wait_for(d, lambda _: "cancelling" in row(held_id).text, "the row never showed cancelling")
    finally:
        models.engine.holding = False
    wait_for(d, lambda _: "cancelled" in row(held_id).text, "the row never showed cancelled")
    assert batch_status(live, held_id) == "cancelled"
    assert "completed" in row(done_id).text and not row(held_id).find_elements(By.TAG_NAME, "button")
    print("\nweb page screenshot:", tmp_path / "batches.png")
    errors = [e for e in d.get_log("browser") if e["level"] == "SEVERE" and "Failed to load resource" not in e["message"]]
    assert not errors, errors
