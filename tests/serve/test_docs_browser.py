"""/docs in a real browser: Debian's headless Chromium, driven by Playwright (its Python package, with the system
browser: no browser download), opens the Swagger UI of a real uvicorn server (the tiny artifact) and asks a
question through it (expand POST /predict, "Try it out", fill the body, "Execute"). Every request the page makes
must go to the server on loopback: other host names do not resolve in this browser, and any request to another
host is aborted and fails the test. So the page's scripts, styles and icon come from the app (ibedl/serve/docs_ui.py)
and the answer it shows is the service's.

Chromium comes from Debian's ``chromium`` package, which ``make test`` installs (make test-servers-deps) when root.
The test is skipped only where Chromium is missing and this user cannot install it.
"""

from __future__ import annotations

import json
import os
import shutil
from urllib.parse import urlsplit

import httpx
import pytest

from ibedl.serve.app import create_app
from ibedl.serve.settings import Settings
from tests.serve.conftest import uvicorn_server

pytestmark = pytest.mark.servers

QUESTION = {"id": "asked-from-the-docs-page", "question": "Which is the sun?",
            "options": ["sun", "moon", "tree", "fish"]}
LOOPBACK = "127.0.0.1"


def chromium_binary() -> str:
    for name in ("chromium", "chromium-browser"):
        if path := shutil.which(name):
            return path
    if os.geteuid() == 0 and shutil.which("apt-get"):
        raise AssertionError("Chromium is not installed: make test-servers-deps installs it (Debian package chromium)")
    pytest.skip("Chromium is not installed and this user cannot install it: "
                "sudo apt-get install --no-install-recommends chromium")


@pytest.fixture
def server(tiny_artifact):
    settings = Settings(artifact=tiny_artifact, drift_bootstrap=100, max_tokens=96)
    with uvicorn_server(create_app(settings), LOOPBACK) as url:
        yield url


def test_the_docs_page_answers_a_question_with_no_network_beyond_loopback(server):
    from playwright.sync_api import sync_playwright

    executable = chromium_binary()
    elsewhere: list[str] = []  # requests the page tried to send off this machine
    seen: list[str] = []

    def only_loopback(route):
        url = route.request.url
        if urlsplit(url).hostname == LOOPBACK:
            seen.append(url)
            route.continue_()
        else:
            elsewhere.append(url)
            route.abort()

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=executable,
            # Every host name but the server's fails to resolve, so nothing can leave the machine by name either.
            args=[f"--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE {LOOPBACK}", "--disable-background-networking"])
        try:
            context = browser.new_context()
            context.route("**/*", only_loopback)
            page = context.new_page()
            page.set_default_timeout(60_000)
            page_errors: list[str] = []
            page.on("pageerror", lambda error: page_errors.append(str(error)))

            response = page.goto(server + "/docs")
            assert response is not None and response.status == 200
            page.wait_for_load_state("load")
            assert elsewhere == [], f"the docs page tried to leave the machine: {elsewhere}"
            page.locator(".opblock-summary-path[data-path='/predict']").click()
            operation = page.locator(".opblock.opblock-post", has=page.locator("[data-path='/predict']"))
            operation.locator("button.try-out__btn").click()
            operation.locator("textarea.body-param__text").fill(json.dumps(QUESTION))
            with page.expect_response(lambda r: r.url == server + "/predict" and r.request.method == "POST") as asked:
                operation.locator("button.execute").click()
            answer = asked.value
            assert answer.status == 200, answer.text()
            body = answer.json()
            # What the page shows is that answer: the live response's status and body.
            shown = operation.locator(".live-responses-table .response")
            assert shown.locator(".response-col_status").first.inner_text().strip() == "200"
            shown_body = json.loads(shown.locator(".response-col_description pre").first.inner_text())
        finally:
            browser.close()

    assert elsewhere == [], f"the docs page tried to leave the machine: {elsewhere}"
    assert page_errors == []
    paths = {urlsplit(url).path for url in seen}
    assert {"/docs", "/docs/assets/swagger-ui-bundle.js", "/docs/assets/swagger-ui.css", "/openapi.json",
            "/predict"} <= paths
    # The same question asked directly gets the same answer (the model is deterministic).
    direct = httpx.post(server + "/predict", json=QUESTION, timeout=60)
    assert direct.status_code == 200, direct.text
    assert body == shown_body == direct.json()
    assert body["id"] == QUESTION["id"]
    assert body["prediction"]["text"] == QUESTION["options"][body["prediction"]["index"]]
    assert sum(body["probabilities"].values()) == pytest.approx(1.0, abs=1e-6)
