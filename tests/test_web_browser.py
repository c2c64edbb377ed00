"""The chat page in a real browser (Debian's chromium, headless, through Selenium) against the demo model's
server: what a person does with it, read back from the page, through the selectors shared/DESIGN.md names.

Without chromium and chromedriver the tests skip, saying so; CI installs both and sets PAGEDCHAT_REQUIRE_BROWSER=1,
which turns the skip into a failure. PAGEDCHAT_SCREENSHOTS=DIR saves the README's screenshots there.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from bench_web import (browser_paths, chromium, click, open_page, send_and_wait, token_to_screen_ms,  # noqa: E402
                       wait_for_reply, wait_until, write_long_session)

if browser_paths() is None:
    if os.environ.get("PAGEDCHAT_REQUIRE_BROWSER"):
        raise RuntimeError("PAGEDCHAT_REQUIRE_BROWSER is set but chromium or chromedriver is missing")
    pytest.skip("chromium and chromedriver are not installed (apt install chromium chromium-driver)",
                allow_module_level=True)

from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402

from serve_util import serving_page, slow_steps  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    sessions = tmp_path_factory.mktemp("data") / "pagedchat" / "sessions"
    with serving_page("demo", sessions) as (url, aengine):
        yield url, aengine, sessions


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    downloads = tmp_path_factory.mktemp("downloads")
    driver = chromium(downloads)
    driver.downloads = downloads
    yield driver
    driver.quit()


@pytest.fixture
def page(server, browser):
    """The page on a new session of its own; (driver, server URL, engine, session folder, session name)."""
    url, aengine, sessions = server
    open_page(browser, url)
    click(browser, "[data-action=new-session]")
    name = wait_until(lambda: browser.execute_script(
        "const s = window.__pagedchat.session; return s && s.nodes.length === 0 ? s.name : null"))
    return browser, url, aengine, sessions, name


def q(driver, selector):
    return driver.find_elements(By.CSS_SELECTOR, selector)


def messages(driver) -> list[tuple[str, str]]:
    """(role, node id) of each message on the current path, as shown."""
    return [tuple(x) for x in driver.execute_script(   # one read of the page: it may redraw between two
        "return [...document.querySelectorAll('#messages > [data-role]')].map(m => [m.dataset.role, m.dataset.nodeId])")]


def texts(driver, selector) -> list[str]:
    """The shown text of each element `selector` finds, in one read (an element found in one call and read in the
    next may have been redrawn between them: a stale element)."""
    return driver.execute_script("return [...document.querySelectorAll(arguments[0])].map(e => e.innerText)",
                                 selector)


def saved(sessions: Path, name: str) -> dict:
    return json.loads((sessions / f"{name}.json").read_text())



def screenshot(driver, name: str) -> None:
    folder = os.environ.get("PAGEDCHAT_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(folder) / name))


def test_send_regenerate_edit_fork_pick_and_reload(page):
    driver, _, aengine, sessions, name = page
    with slow_steps(aengine, 0.01):            # a few frames per reply: the stream is seen, not just its end
        send_and_wait(driver, "What can you do?")
    shown = messages(driver)
    assert [r for r, _ in shown] == ["user", "assistant"] and all(i for _, i in shown)
    paints = driver.execute_script("return window.__pagedchat.paints")
    assert len({p["chars"] for p in paints}) >= 2, "the reply did not arrive in pieces"
    assert len(token_to_screen_ms(driver)) == len(paints)
    first = texts(driver, "[data-role=assistant] [data-content]")[0]
    assert first and saved(sessions, name)["nodes"][1]["text"].startswith(first.split()[0])

    # regenerate: a second version, with sibling arrows; back to the first
    click(driver, "[data-role=assistant] [data-action=regenerate]")
    wait_for_reply(driver)
    assert texts(driver, "[data-role=assistant] [data-sibling-pos]")[0] == "2/2"
    click(driver, "[data-role=assistant] [data-action=prev-sibling]")
    wait_until(lambda: q(driver, "[data-role=assistant] [data-sibling-pos]")[0].text == "1/2")
    assert texts(driver, "[data-role=assistant] [data-content]")[0] == first

    # edit the message: a sibling branch with its own reply
    click(driver, "[data-role=user] [data-action=edit]")
    area = q(driver, "textarea[name=edit]")[0]
    area.clear()
    area.send_keys("What is 2 + 3?", Keys.ENTER)
    wait_for_reply(driver)
    assert texts(driver, "[data-role=user] [data-sibling-pos]")[0] == "2/2"
    assert "What is 2 + 3?" in texts(driver, "[data-role=user]")[0]

    # fork 3: three columns streaming at once; continue from the second
    driver.find_element(By.CSS_SELECTOR, "textarea[name=message]").send_keys("Name a capital city.")
    fork_n = driver.find_element(By.CSS_SELECTOR, "input[name=fork-n]")
    fork_n.clear()
    fork_n.send_keys("3")
    click(driver, "[data-action=fork]")
    wait_for_reply(driver)
    columns = q(driver, "[data-variant]")
    assert [c.get_attribute("data-variant") for c in columns] == ["1", "2", "3"]
    ids = [c.get_attribute("data-node-id") for c in columns]
    tree = saved(sessions, name)
    assert sorted(int(i) for i in ids) == sorted(tree["last_fork"])
    screenshot(driver, "web-fork.png")
    click(driver, '[data-variant="2"] [data-action=pick]')
    wait_until(lambda: not q(driver, "[data-variant]") and messages(driver)[-1][1] == ids[1])
    send_and_wait(driver, "Thanks!")
    path = [i for _, i in messages(driver)]
    assert ids[1] in path and path[-1] == str(saved(sessions, name)["head"])

    # reload: the same session, branch and tree
    outline = len(q(driver, "#outline [role=treeitem]"))
    driver.refresh()
    wait_until(lambda: driver.execute_script("return document.documentElement.dataset.ready === 'true'"))
    assert [i for _, i in messages(driver)] == path
    assert len(q(driver, "#outline [role=treeitem]")) == outline == len(saved(sessions, name)["nodes"])
    screenshot(driver, "web-tree.png")


def test_the_outline_moves_between_branches_with_the_keyboard(page):
    driver, _, _, sessions, name = page
    send_and_wait(driver, "What is 2 + 2?")
    click(driver, "[data-role=assistant] [data-action=regenerate]")
    wait_for_reply(driver)
    tree = saved(sessions, name)
    first, second = tree["nodes"][1]["id"], tree["head"]
    assert messages(driver)[-1][1] == str(second)
    driver.execute_script("arguments[0].focus()", q(driver, "#outline [role=treeitem]")[0])   # the message
    driver.switch_to.active_element.send_keys(Keys.ARROW_DOWN)                                # its first reply
    assert driver.switch_to.active_element.get_attribute("data-outline-node") == str(first)
    driver.switch_to.active_element.send_keys(Keys.ENTER)
    wait_until(lambda: messages(driver)[-1][1] == str(first))
    assert saved(sessions, name)["head"] == first


def test_a_session_the_repl_wrote_opens_and_continues(page):
    from chat_support import make_controller, make_engine
    from pagedchat.registry import Registry

    driver, url, _, sessions, _ = page
    demo = Path(Registry().resolve("demo").path)
    repl = make_controller(make_engine(demo), demo, sessions)
    repl.new_session("from-repl")
    repl.send("What is 12 + 30?")
    driver.refresh()
    open_page(driver, url)
    click(driver, '[data-session="from-repl"]')
    wait_until(lambda: len(messages(driver)) == 2)
    wait_until(lambda: "12 + 30" in "".join(texts(driver, "[data-role=user]")))
    send_and_wait(driver, "And 1 + 1?")
    nodes = saved(sessions, "from-repl")["nodes"]
    assert [n["role"] for n in nodes] == ["user", "assistant", "user", "assistant"]
    assert nodes[2]["parent"] == nodes[1]["id"] and nodes[0]["token_ids"] == repl.session.tree.get(1).token_ids


def test_stop_a_reply_mid_stream(page):
    driver, _, aengine, sessions, name = page
    with slow_steps(aengine, 0.1):
        driver.find_element(By.CSS_SELECTOR, "textarea[name=message]").send_keys("Tell me about yourself.")
        click(driver, "[data-action=send]")
        wait_until(lambda: q(driver, "[data-role=assistant] [data-content]")
                   and q(driver, "[data-role=assistant] [data-content]")[-1].text.strip())
        stop = driver.find_element(By.CSS_SELECTOR, "[data-action=stop]")
        assert stop.is_displayed()
        stop.click()
        wait_for_reply(driver)
    reply = saved(sessions, name)["nodes"][1]
    assert reply["interrupted"] is True and reply["finish_reason"] == "interrupted"
    assert "interrupted" in q(driver, "[data-role=assistant]")[-1].text
    assert not driver.find_element(By.CSS_SELECTOR, "[data-action=stop]").is_displayed()


PAYLOADS = ['<script>window.__xss = 1</script>', '<img src=x onerror="window.__xss = 2">',
            '[click me](javascript:window.__xss=3)', '<a href="javascript:window.__xss=4">link</a>',
            '<svg onload="window.__xss = 5"></svg>', '<iframe src="javascript:window.__xss=6"></iframe>',
            '<b>raw html</b>']


def test_xss_in_messages_and_replies_is_inert_and_shown_as_text(page):
    from pagedchat.chat.store import SessionStore

    driver, url, _, sessions, name = page
    store = SessionStore(sessions)
    session = store.load(name)
    parent = None
    for payload in PAYLOADS:
        user = session.tree.add(parent, "user", "say " + payload, [1, 2])
        parent = session.tree.add(user.id, "assistant", "here: " + payload + "\n\n" + payload, [3, 4]).id
    session.head = parent
    session.system = '<script>window.__xss = 7</script>'
    store.save(session)
    driver.refresh()
    open_page(driver, url)
    wait_until(lambda: len(messages(driver)) == 2 * len(PAYLOADS))
    for link in q(driver, "#messages a"):
        assert not (link.get_attribute("href") or "").lower().startswith("javascript:")
        link.click()
    driver.switch_to.window(driver.window_handles[0])
    time.sleep(0.2)
    assert driver.execute_script("return window.__xss === undefined")
    page_text = driver.find_element(By.ID, "messages").text
    assert "<script>window.__xss = 1</script>" in page_text and "<b>raw html</b>" in page_text
    assert not q(driver, "#messages script, #messages img, #messages svg, #messages iframe, #messages b")


def test_export_downloads_the_whole_tree(page):
    driver, _, _, sessions, name = page
    send_and_wait(driver, "What is 2 + 2?")
    click(driver, "[data-role=assistant] [data-action=regenerate]")
    wait_for_reply(driver)
    for action, suffix in (("export-markdown", "md"), ("export-json", "json")):
        click(driver, f"[data-action={action}]")
        target = driver.downloads / f"{name}.{suffix}"
        wait_until(lambda: target.is_file() and target.stat().st_size > 0, what=f"{target.name}")
    assert (driver.downloads / f"{name}.md").read_text().count("## branch") == 2
    assert json.loads((driver.downloads / f"{name}.json").read_text())["nodes"] == saved(sessions, name)["nodes"]


def test_page_speed_is_measured(page, server):
    """Records the page's figures (no threshold: scripts/bench_web.py measures them on a quiet machine for
    docs/benchmarks.md): first paint, token to screen, a 500-message session's open."""
    driver, url, _, sessions, _ = page
    write_long_session(sessions, "long", 500)
    open_page(driver, url)
    paint = driver.execute_script("return performance.getEntriesByName('first-contentful-paint')[0].startTime")
    click(driver, '[data-session="long"]')
    opened = wait_until(lambda: driver.execute_script(
        "return window.__pagedchat.session.name === 'long' && window.__pagedchat.timings.open_ms"))
    assert len(messages(driver)) == 500 and paint > 0 and opened > 0
    print(f"\nfirst paint {paint:.0f} ms; 500-message session opened in {opened:.0f} ms")


def test_reasoning_is_folded_away(page):
    from pagedchat.chat.store import SessionStore

    driver, url, _, sessions, name = page
    store = SessionStore(sessions)
    session = store.load(name)
    user = session.tree.add(None, "user", "think first", [1])
    session.head = session.tree.add(user.id, "assistant", "<think>secret steps</think>The **answer**.", [2]).id
    store.save(session)
    driver.refresh()
    open_page(driver, url)
    reply = wait_until(lambda: q(driver, "[data-role=assistant] [data-content]"))[0]
    details = reply.find_element(By.CSS_SELECTOR, "details.reasoning")
    assert details.get_attribute("open") is None and "secret steps" not in reply.text
    assert reply.find_element(By.CSS_SELECTOR, "strong").text == "answer"
    details.find_element(By.TAG_NAME, "summary").click()
    assert "secret steps" in reply.text


def test_with_an_api_key_the_page_asks_for_it(browser, tmp_path):
    with serving_page("demo", tmp_path / "sessions", api_key="sekrit") as (url, _):
        browser.execute_script("sessionStorage.clear()")
        browser.get(url)
        dialog = wait_until(lambda: [d for d in q(browser, "#key-dialog") if d.is_displayed()])[0]
        dialog.find_element(By.CSS_SELECTOR, "input[name=api-key]").send_keys("sekrit", Keys.ENTER)
        wait_until(lambda: browser.execute_script("return document.documentElement.dataset.ready === 'true'"))
        assert browser.find_element(By.ID, "model-name").text == "demo"
        send_and_wait(browser, "What is 2 + 2?")
        assert len(messages(browser)) == 2
        browser.execute_script("sessionStorage.clear()")
