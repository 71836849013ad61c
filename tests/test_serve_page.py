"""The page at `/` in a real headless Chromium (Debian's `chromium`, driven by Playwright): load it, type, run,
check what it shows for each kind of model against the server's own answer. Skipped, with the reason, where
Chromium or Playwright is absent."""

import shutil

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install 'bertforge[serve]')")
pytest.importorskip("httpx", reason="httpx is not installed (pip install 'bertforge[serve]')")
sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (pip install playwright)")

from serve_helpers import LIMIT, model_dirs, post, running  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (Debian: apt-get install chromium)"),
    pytest.mark.slow,  # a browser and a server per module: seconds
]
MS = LIMIT * 1000


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return model_dirs(tmp_path_factory.mktemp("page"))


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True,
                                              args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        yield chromium
        chromium.close()


def load(page, url: str) -> None:
    page.goto(url + "/", timeout=MS)
    page.wait_for_selector("#modes button[aria-pressed=true]", timeout=MS)


def run(page, text: str, second: str | None = None) -> None:
    """Type, press Run, wait for what the page shows."""
    page.evaluate("document.getElementById('result').replaceChildren()")
    page.fill("#text", text)
    if second is not None:
        page.fill("#second", second)
    page.click("#submit")
    page.wait_for_selector("#result > *", timeout=MS)


def test_page_shows_labels_with_probabilities_and_an_embedding(browser, models):
    page = browser.new_page()
    with running(models["clf"]) as (url, _):
        load(page, url)
        run(page, "the film was good .")
        expected = post(url, "/predict", {"inputs": "the film was good ."}).json()
        assert page.text_content("#result .label") == f"{expected['label']} ({expected['score']:.3f})"
        rows = page.locator("#result .row").all_inner_texts()
        assert [r.split()[0] for r in rows] == sorted(expected["probabilities"], key=expected["probabilities"].get,
                                                      reverse=True)
        assert "classification" in page.text_content("#model")
        page.click("#modes button[data-endpoint='/embed']")
        page.select_option("#pooling", "mean")
        page.check("#normalize")
        run(page, "the film was good .")
        assert page.text_content("#result .label") == "32 dimensions, norm 1.0000"
    page.close()


def test_page_highlights_entities_and_the_answer_and_shows_refusals(browser, models):
    page = browser.new_page()
    text = "john smith lives in paris"
    with running(models["ner"]) as (url, _):
        load(page, url)
        run(page, text)
        marks = page.locator("#result mark").all_inner_texts()  # each mark: the entity, then its type
        assert marks == [f"{word}PER" for word in text.split()]
        assert page.locator("#result mark small").all_inner_texts() == ["PER"] * len(marks)
        assert page.text_content("#result .passage").replace("PER", "") == text
    context = "john smith lives in paris and works in the film"
    with running(models["qa"]) as (url, _):
        load(page, url)
        assert page.is_visible("#second") and page.text_content("#text-label") == "Question"
        run(page, "where does john live ?", context)
        answer = post(url, "/predict", {"inputs": {"question": "where does john live ?", "context": context}}).json()
        assert page.text_content("#result mark") == answer["answer"] == context[answer["start"]:answer["end"]]
        run(page, "a question without its context", "")
        assert page.text_content("#result .error").startswith("inputs.context: a question answering model needs")
    page.close()


def test_page_shows_fill_mask_candidates(browser, models):
    page = browser.new_page()
    with running(models["mlm"]) as (url, _):
        load(page, url)
        assert page.locator("#modes button").all_inner_texts() == ["Fill mask", "Embed"]
        run(page, "the [MASK] was good .")
        [candidates] = post(url, "/fill-mask", {"inputs": "the [MASK] was good ."}).json()
        assert page.text_content("#result mark") == candidates[0]["token"]
        rows = page.locator("#result .row").all_inner_texts()
        assert [r.split()[0] for r in rows] == [c["token"] for c in candidates]
        assert page.text_content("#result .passage") == f"the {candidates[0]['token']} was good ."
        run(page, "no mask here")
        assert page.text_content("#result .error").startswith("inputs: no [MASK] in the text")
    page.close()


def test_page_asks_for_the_api_key_when_the_server_wants_one(browser, models):
    page = browser.new_page()
    with running(models["clf"], api_key="s3cret") as (url, _):
        page.goto(url + "/", timeout=MS)
        page.wait_for_selector("#key", state="visible", timeout=MS)
        assert "API key" in page.text_content("#model")
        page.fill("#key", "s3cret")
        run(page, "the film was good .")
        expected = post(url, "/predict", {"inputs": "the film was good ."},
                        headers={"authorization": "Bearer s3cret"}).json()
        assert page.text_content("#result .label") == f"{expected['label']} ({expected['score']:.3f})"
    page.close()


def test_page_shows_a_score_and_the_choices_with_their_probabilities(browser, models):
    page = browser.new_page()
    with running(models["reg"]) as (url, _):
        load(page, url)
        run(page, "the film was good", "a great movie")
        expected = post(url, "/predict", {"inputs": {"text": "the film was good", "text_pair": "a great movie"}}).json()
        assert page.text_content("#result .label") == f"score {expected['score']:.4f}"
    choices = ["over the fox", "in paris", "the plot"]
    with running(models["mc"]) as (url, _):
        load(page, url)
        assert page.text_content("#second-label") == "Choices, one per line"
        run(page, "the dog jumps", "\n".join(choices))
        expected = post(url, "/predict", {"inputs": {"context": "the dog jumps", "choices": choices}}).json()
        assert page.text_content("#result .label") == choices[expected["choice"]]
        rows = page.locator("#result .row").all_inner_texts()
        assert [r.rsplit(maxsplit=1)[1] for r in rows] == [f"{p:.3f}" for p in expected["probabilities"]]
    page.close()
