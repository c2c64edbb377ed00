"""The REPL driven through prompt-toolkit's pipe input: type keys, read what the screen shows.

The screen is the rich console (a StringIO); prompt-toolkit draws its prompt to a DummyOutput. Every slash
command is exercised, and Ctrl-C during a reply, at the prompt, and Ctrl-D.
"""

import json
import signal
import threading
import time

import pytest

from chat_support import make_controller, make_engine, text_console

pytest.importorskip("prompt_toolkit")

ENTER, ESC_ENTER, TAB, CTRL_C, CTRL_D = "\r", "\x1b\r", "\t", "\x03", "\x04"


@pytest.fixture
def ctl(model, tmp_path):
    c = make_controller(make_engine(model), model, tmp_path / "data" / "pagedchat" / "sessions")
    c.new_session("main")
    return c


@pytest.fixture
def repl(ctl, tmp_path):
    """type(keys) runs the REPL on those keys (then Ctrl-D) and returns what the screen shows."""
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    from pagedchat.chat.repl import run_repl

    def type_keys(*lines: str, raw: str = "", slowly: list[str] | None = None) -> str:
        """lines (each + Enter), then raw keys; `slowly`: chunks typed 0.3 s apart, as a person would (Tab
        completion runs asynchronously and must see the keys before it)."""
        console, screen = text_console()
        with create_pipe_input() as pipe:
            pipe.send_text("".join(line + ENTER for line in lines) + raw)
            done = threading.Event()
            typist = threading.Thread(target=_type_slowly, args=(pipe, slowly or [], done))
            typist.start()
            try:
                code = run_repl(ctl, console, pt_input=pipe, pt_output=DummyOutput(),
                                history_path=tmp_path / "hist")
            finally:
                done.set()
                typist.join()
        assert code == 0
        text = screen.getvalue()
        assert "Traceback" not in text
        return text

    return type_keys


def _type_slowly(pipe, chunks: list[str], done: threading.Event) -> None:
    for chunk in chunks:
        time.sleep(0.3)
        pipe.send_text(chunk)
    time.sleep(0.3)
    pipe.send_text(CTRL_D)
    if not done.wait(60):  # the REPL is stuck waiting for keys: end its input so the test fails, not hangs
        pipe.close()


def _stats_lines(screen: str) -> list[str]:
    return [line for line in screen.splitlines() if " new + " in line and "cached" in line]


def test_chat_turns_show_a_stats_line_with_cache_hits(repl, ctl):
    screen = repl("hello world", "what is 17 + 25?")
    lines = _stats_lines(screen)
    assert len(lines) == 2
    assert "prompt" in lines[0] and " 0 cached" in lines[0]
    cached = int(lines[1].split(" new + ")[1].split(" cached")[0])
    assert cached > 0  # the whole first exchange came from the pinned branch
    for part in ("TTFT", "tok/s", "KV", "blocks"):
        assert part in lines[1]
    assert len(ctl.session.path()) == 4


def test_help_lists_every_design_command(repl):
    screen = repl("/help", "/help fork", "/? ")
    for command in ("/help", "/exit", "/new", "/sessions", "/open NAME", "/save", "/tree", "/switch ID", "/regen",
                    "/edit ID", "/fork N", "/pick K", "/system", "/set", "/stats", "/clear"):
        assert command in screen, command
    assert "forks of one sequence" in screen


def test_fork_tree_switch_regen_pick(repl, ctl):
    screen = repl("hello world", "/fork 3", "/tree", "/pick 2", "/switch 2", "/regen", "/tree")
    assert "variant 1 · #" in screen and "variant 2 · #" in screen and "variant 3 · #" in screen
    assert "temperature is 0, so the 3 variants would be identical" in screen
    assert "continuing from variant 2" in screen
    assert "head is now #2" in screen
    tree = ctl.session.tree
    user = tree.get(1)
    replies = tree.children(user.id)
    assert [r.variant for r in replies] == [None, 1, 2, 3, None]  # first reply, 3 variants, the regen
    assert ctl.session.head == replies[-1].id
    assert "v1" in screen and "v3" in screen and "◀ head" in screen
    saved = json.loads(ctl.store.path("main").read_text())
    assert sorted(n["variant"] for n in saved["nodes"] if n["variant"]) == [1, 2, 3]


def test_edit_with_text_and_in_place(repl, ctl):
    screen = repl("hello world", "what is 17?", "/edit 3 what is 25?", "/edit 1", raw=" again" + ENTER)
    users = [n for n in ctl.session.tree.nodes.values() if n.role == "user"]
    assert [u.text for u in users] == ["hello world", "what is 17?", "what is 25?", "hello world again"]
    assert users[2].parent == users[1].parent  # a sibling branch, the original stays
    assert users[3].parent is None and ctl.session.path()[0].id == users[3].id
    assert len(_stats_lines(screen)) == 4
    screen = repl("/edit 2 nope", "/edit", "/edit x")
    assert "/edit changes user messages" in screen and screen.count("usage: /edit ID") == 2


def test_ctrl_c_during_a_reply_keeps_the_partial_reply(repl, ctl, monkeypatch):
    ctl.cli.max_tokens = 200
    real_step, steps = ctl.engine.step, []

    def step():
        steps.append(1)
        if len(steps) == 4:
            signal.raise_signal(signal.SIGINT)  # what Ctrl-C in the terminal does
        return real_step()

    monkeypatch.setattr(ctl.engine, "step", step)
    screen = repl("tell me a story", "/tree")
    reply = ctl.session.tree.get(2)
    assert reply.interrupted and 0 < len(reply.token_ids) < 20
    assert "interrupted: the partial reply is kept as #2" in screen and "[interrupted]" in screen
    assert ctl.engine.pool.num_used == 0  # aborted at once: its blocks are free
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    saved = json.loads(ctl.store.path("main").read_text())
    assert saved["nodes"][1]["interrupted"] is True
    monkeypatch.setattr(ctl.engine, "step", real_step)
    ctl.cli.max_tokens = 8
    screen = repl("go on")  # the REPL goes on from the partial reply
    assert len(_stats_lines(screen)) == 1 and ctl.session.tree.get(3).parent == 2


def test_ctrl_c_at_the_prompt_clears_the_line_and_ctrl_d_exits(repl, ctl):
    screen = repl(raw="half typed" + CTRL_C + "/tree" + ENTER)
    assert "session main" in screen and "half typed" not in screen
    assert len(ctl.session.tree) == 0


def test_sessions_new_open_save(repl, ctl):
    screen = repl("hello world", "/new other", "a b c", "/sessions", "/open main", "/save", "/save renamed",
                  "/sessions")
    assert "new session other" in screen
    assert "session main: 2 messages" in screen
    assert set(ctl.sessions) == {"renamed", "other"} and ctl.session.name == "renamed"
    assert ctl.store.exists("renamed") and ctl.store.exists("main") and ctl.store.exists("other")
    assert "renamed" in screen.split("saved renamed")[1]
    blocks = ctl.pool_stats()["sessions"]
    assert blocks["other"]["blocks"] > 0 and blocks["renamed"]["blocks"] > 0  # both resident in one pool
    screen = repl("/open nope", "/open", "/new main")
    assert "no session named 'nope'" in screen and "usage: /open NAME" in screen and "already exists" in screen


def test_system_set_stats_clear(repl, ctl):
    screen = repl("/system", "/system be brief", "/system", "hello world", "/set", "/set top_k 5",
                  "/set top_p 7", "/set nope 1", "/set seed", "/stats", "/clear", "/show")
    assert "no system prompt" in screen and "system prompt: 'be brief'" in screen
    assert ctl.session.tree.get(1).role == "system"
    assert "top_k = 5" in screen and "top_p must be in (0, 1], got 7.0" in screen
    assert "unknown setting 'nope'; keys: temperature, top_p, top_k, min_p, max_tokens, seed, " \
           "repetition_penalty, stop" in screen
    assert "usage: /set seed VALUE" in screen
    assert "command-line flag" in screen  # /set shows where each value comes from
    for part in ("KV pool", "used", "free", "cached", "shared", "prefix cache", "hit rate", "blocks held"):
        assert part in screen, part
    assert "new conversation" in screen and "no messages on this branch yet" in screen
    assert ctl.store.load("main").settings == {"top_k": 5}


def test_unknown_commands_literal_slash_blocks_and_newlines(repl, ctl):
    paste = "\x1b[200~pasted one\npasted two\x1b[201~"  # bracketed paste: newlines do not send
    screen = repl("/bogus", "/tre", "//not a command", '"""', "line one", 'line two"""',
                  raw="first" + ESC_ENTER + "second" + ENTER + paste + ENTER)
    assert "unknown command /bogus" in screen and "did you mean /tree" in screen
    users = [n.text for n in ctl.session.tree.nodes.values() if n.role == "user"]
    assert users == ["/not a command", "line one\nline two", "first\nsecond", "pasted one\npasted two"]


def test_tab_completes_commands_and_history_is_kept(repl, ctl, tmp_path):
    screen = repl(slowly=["/tr", TAB, ENTER + "hello world" + ENTER, "/swi", TAB, "#1" + ENTER])
    assert "unknown command" not in screen
    assert "└── #1 user" not in screen and "head is now #1" in screen  # /tree ran on the empty session
    history = (tmp_path / "hist").read_text()
    assert "+/tree" in history and "+hello world" in history and "+/switch #1" in history
    screen = repl(raw="\x1b[A" + ENTER)  # up-arrow recalls the last line: /switch #1 again
    assert "head is now #1" in screen
    ctl.switch(2)
    repl(slowly=["\x12", "hello", ENTER, ENTER])  # Ctrl-R finds "hello world" in the history and sends it
    assert [n.text for n in ctl.session.tree.nodes.values() if n.role == "user"] == ["hello world"] * 2


def test_completer_offers_arguments(ctl):
    from prompt_toolkit.document import Document

    from pagedchat.chat.repl import _completer
    from pagedchat.chat.shell import ChatShell, ChatUI

    ctl.send("hello world")
    completer = _completer(ChatShell(ctl, ChatUI(text_console()[0])))

    def complete(text):
        return [c.text for c in completer.get_completions(Document(text), None)]

    assert complete("/s") == ["/save ", "/sessions", "/set ", "/show", "/stats", "/switch ", "/system "]
    assert complete("/set te") == ["temperature"]
    assert complete("/switch ") == ["1", "2"] and complete("/edit ") == ["1"]
    assert complete("/open m") == ["main"]
    assert complete("/logprobs o") == ["on", "off"] and complete("/think h") == ["hide"]
    assert complete("hello") == []


def test_a_failing_command_never_shows_a_traceback(repl, ctl, monkeypatch):
    def broken():
        raise RuntimeError("boom")

    monkeypatch.setattr(ctl, "pool_stats", broken)
    screen = repl("/stats", "/tree")
    assert "internal error: RuntimeError: boom" in screen and "session main" in screen


def test_piped_stdin_runs_the_same_commands(ctl, monkeypatch):
    import io

    from pagedchat.chat.repl import run_repl

    console, screen = text_console()
    monkeypatch.setattr("sys.stdin", io.StringIO('hello world\n"""\na\nb"""\n/tree\n/exit\nnever sent\n'))
    assert run_repl(ctl, console) == 0
    assert [n.text for n in ctl.session.tree.nodes.values() if n.role == "user"] == ["hello world", "a\nb"]
    assert "session main" in screen.getvalue()


def test_beam_shows_hypotheses_best_first_and_pick_continues(repl, ctl):
    screen = repl("/beam 3 hello world", "/pick 2", "what next?")
    assert "variant 1 · #" in screen and "variant 3 · #" in screen
    assert "beam scores, best first: 1: " in screen
    assert "continuing from variant 2" in screen
    tree = ctl.session.tree
    replies = tree.children(1)
    assert [r.variant for r in replies] == [1, 2, 3]
    assert tree.get(ctl.session.head).role == "assistant"
    assert tree.path(ctl.session.head)[1].id == replies[1].id   # the next turn continues hypothesis 2
    assert "usage: /beam W [MESSAGE]" in repl("/beam")


def test_set_schema_constrains_replies(repl, ctl, tmp_path):
    import jsonschema

    schema = {"enum": ["yes", "no", [1, 2]]}     # short: the test controller's replies stop at 8 tokens
    (tmp_path / "s.json").write_text(json.dumps(schema))
    (tmp_path / "bad.json").write_text(json.dumps({"type": "object", "properties": {"a": {"$ref": "#/none"}}}))
    screen = repl(f"/set schema {tmp_path / 's.json'}", "hello world",
                  f"/set schema {tmp_path / 'bad.json'}", f"/set schema {tmp_path / 'missing.json'}",
                  "/set schema off", "hello again")
    replies = [n.text for n in ctl.session.tree.nodes.values() if n.role == "assistant"]
    jsonschema.validate(json.loads(replies[0]), schema)
    assert "every reply is JSON valid for it" in screen and "unsupported json schema" in screen
    assert "cannot read JSON schema" in screen and "schema off" in screen
    assert len(replies) == 2 and ctl.schema is None


def test_logprobs_and_branch_typed_at_the_prompt(repl, ctl):
    """A person turns /logprobs on, reads the alternatives under the reply, and branches from one."""
    screen = repl("/logprobs on", "tell me a story", "/logprobs", "/branch 2 1", "/tree")
    first, second = [n for n in ctl.session.tree.nodes.values() if n.role == "assistant"]
    assert second.parent == first.parent and second.token_ids[:2] == first.token_ids[:2]
    assert second.token_ids[2] == first.logprobs[2][1][1][0] != first.token_ids[2]
    assert f"#{first.id} tokens (index" in screen            # /logprobs: every token of the head reply
    rows = [line for line in screen.splitlines() if line.strip().split(" ")[:1] == ["2"] and " · 1 " in line]
    assert rows       # token 2 and its alternatives, rank 1 first
    assert len([line for line in screen.splitlines() if " new + " in line]) == 2   # two turns, two stats lines


def test_control_characters_in_a_reply_are_shown_not_obeyed():
    """A reply is printed by a terminal: ESC M (cursor up), ESC [2J (clear), CR, BEL, a C1 CSI must not act.
    Side-by-side variants keep their titles and each reply its text, the controls as visible pictures; a pipe
    gets the text as generated."""
    from pagedchat.chat import render
    from pagedchat import words

    nasty = "ten q\x1bMjmps\x1b[2J \rback\x07 c1\x9b5A end"
    console, buffer = text_console(width=120)
    console.print(render.variants_view([nasty, "plain"], ["variant 1 · #5", "variant 2 · #6"], 120))
    console.print(render.reply_view(nasty))
    shown = buffer.getvalue()
    assert not any(c in shown for c in "\x1b\r\x07\x9b")
    assert "variant 2 · #6" in shown and "␛Mjmps␛[2J ␍back␇ c1�5A end" in shown
    assert words.for_terminal(nasty).count("\n") == 0 and len(words.for_terminal(nasty)) == len(nasty)
    assert words.for_terminal("tabs\tand\nnewlines stay") == "tabs\tand\nnewlines stay"
    assert words.for_stdout(nasty) == nasty          # pytest's stdout is not a terminal: the text as generated
