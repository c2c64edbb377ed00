"""Everyday use (issue 18): conversations longer than the context, reasoning models, and the rough edges a
new user hit, each with the reproduction that showed it."""

from __future__ import annotations

import json
import shutil

import pytest

from chat_support import make_controller, make_engine, text_console
from cli_util import read_session

# -- rough edges ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", ["", "   ", "\n\t"])
def test_run_refuses_an_empty_prompt_argument(pagedchat_cli, model, prompt):
    code, out, err = pagedchat_cli("run", "-m", str(model), prompt)
    assert code == 2 and out == ""
    assert err.strip() == "pagedchat: error: the prompt is empty"


@pytest.mark.parametrize("args, words", [
    (["--session", "math", "--file", "FILE"], "--session continues one conversation and --file runs a batch"),
    (["-c", "--file", "FILE"], "-c continues one conversation and --file runs a batch"),
    (["--session", "x", "-c", "hi"], "give --session NAME or -c"),
    (["--session", "x", "--raw", "hi"], "--raw has no template"),
    (["--raw", "--system", "be brief", "hi"], "--system needs the chat template"),
])
def test_run_refuses_option_combinations_by_name(pagedchat_cli, model, tmp_path, args, words):
    batch = tmp_path / "prompts.jsonl"
    batch.write_text('{"prompt": "hi"}\n')
    code, out, err = pagedchat_cli("run", "-m", str(model), *[str(batch) if a == "FILE" else a for a in args])
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1


def test_batch_file_unknown_key_names_file_and_line(pagedchat_cli, model, tmp_path):
    batch = tmp_path / "prompts.jsonl"
    batch.write_text('{"prompt": "hello"}\n{"prompt": "hi", "temprature": 0.5}\n')
    code, _, err = pagedchat_cli("run", "-m", str(model), "--file", str(batch))
    assert code == 2
    assert f"{batch}:2: unknown key 'temprature'" in err and "temperature" in err


def test_kv_memory_beyond_the_machine_is_one_line(pagedchat_cli, model):
    code, out, err = pagedchat_cli("run", "-m", str(model), "--kv-memory", "1TiB", "hi")
    assert code == 2 and out == ""
    assert err.startswith("pagedchat: error: --kv-memory 1024.0 GiB is more than the ") and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_a_reply_cut_by_max_tokens_is_marked(pagedchat_cli, model, monkeypatch):
    args = ["run", "-m", str(model), "--raw", "--temperature", "0", "--max-tokens", "3", "Once upon a time"]
    code, out, err = pagedchat_cli(*args[:-1], "--json", args[-1])
    assert json.loads(out)["outputs"][0]["finish_reason"] == "length"
    code, plain, _ = pagedchat_cli(*args)
    assert code == 0 and "[length]" not in plain          # a pipe gets the text alone
    monkeypatch.setattr("pagedchat.words._is_terminal", lambda: True)
    code, out, _ = pagedchat_cli(*args)
    assert out.rstrip().endswith("\x1b[2m[length]\x1b[0m") and out.startswith(plain.rstrip())


def test_tree_marks_length_replies(model, tmp_path):
    from pagedchat.chat.render import tree_view

    ctl = make_controller(make_engine(model), model, tmp_path, max_tokens=2)
    ctl.new_session("t")
    ctl.send("hello")
    console, buffer = text_console()
    console.print(tree_view(ctl.session))
    assert "[length]" in buffer.getvalue()


def test_fork_at_temperature_zero_says_so_before_the_variants(model, tmp_path):
    from pagedchat.chat.shell import ChatShell, ChatUI

    ctl = make_controller(make_engine(model), model, tmp_path)
    ctl.new_session("f")
    console, buffer = text_console()
    ChatShell(ctl, ChatUI(console)).handle("/fork 3 hello")
    screen = buffer.getvalue()
    assert screen.index("sampling at temperature") < screen.index("variant 1")


def test_counts_are_worded_in_the_singular(pagedchat_cli, model, tmp_path):
    from pagedchat.chat.shell import ChatShell, ChatUI

    ctl = make_controller(make_engine(model), model, tmp_path / "data" / "pagedchat" / "sessions")
    ctl.new_session("only")
    ctl.send("hello")
    code, out, _ = pagedchat_cli("sessions", "list")
    assert "1 session in" in out and "1 sessions" not in out
    console, buffer = text_console()
    shell = ChatShell(ctl, ChatUI(console))
    shell.handle(f"/edit {ctl.session.head} hi")
    shell.handle("/open only")
    screen = buffer.getvalue()
    assert "is an assistant message" in screen and "1 branch" in screen and "1 branches" not in screen


# -- context overflow -------------------------------------------------------------------------------------------
def _long_chat(ctl, turns: int):
    for i in range(turns):
        ctl.send(f"message number {i} with a few more words to fill the context up")


def test_drop_oldest_keeps_a_long_chat_going(model, tmp_path):
    engine = make_engine(model, max_model_len=160)
    ctl = make_controller(engine, model, tmp_path, max_tokens=12)
    ctl.new_session("long")
    ctl.set_option("context_overflow", "drop-oldest")
    _long_chat(ctl, 12)
    path = ctl.session.path()
    compacted = [n for n in ctl.session.tree.nodes.values() if n.context]
    assert compacted, "a 12-turn chat in 160 tokens must have dropped turns"
    last = compacted[-1]
    assert last.context["dropped"] and all(i < last.id for i in last.context["dropped"])
    # what the branch sends next is the re-rendered prefix plus everything after the drop, and it fits
    tokens = ctl.session.tree.path_tokens(ctl.session.head)
    assert len(tokens) < 160
    assert tokens[:len(last.context["prefix_ids"])] == last.context["prefix_ids"]
    # the prompt a later turn sends starts with the pinned branch: only the new message is prefilled
    result = ctl.send("one more")
    if not result.user.context:
        assert result.stats["prompt_new"] < 40
    assert len(path) > 6


def test_drop_oldest_prompt_is_a_fresh_render_of_the_kept_turns(model, tmp_path):
    """The kept turns are rendered by the template as a conversation of their own (first-turn rules apply)."""
    from transformers import AutoTokenizer

    engine = make_engine(model, max_model_len=160)
    ctl = make_controller(engine, model, tmp_path, max_tokens=12, system="be brief")
    ctl.new_session("render")
    ctl.set_option("context_overflow", "drop-oldest")
    _long_chat(ctl, 10)
    node = next(n for n in reversed(list(ctl.session.tree.nodes.values())) if n.context)
    path = ctl.session.tree.path(node.id)
    gone = {i for n in path if n.context for i in n.context["dropped"]}
    kept = [n for n in path if n.id not in gone][:-1]
    messages = [{"role": n.role, "content": ctl.templater.content(n)} for n in kept]
    tok = AutoTokenizer.from_pretrained(model)
    full = tok.apply_chat_template(messages + [{"role": "user", "content": node.text}], tokenize=False,
                                   add_generation_prompt=True)
    assert messages[0]["role"] == "system"
    assert ctl.templater.decode(node.context["prefix_ids"] + node.token_ids) == full


def test_stop_policy_refuses_and_set_switches(model, tmp_path):
    from pagedchat.chat.backend import ContextFull

    engine = make_engine(model, max_model_len=160)
    ctl = make_controller(engine, model, tmp_path, max_tokens=12)
    ctl.new_session("stop")
    assert ctl.set_option("context_overflow", "stop") == "context_overflow = stop"
    with pytest.raises(ContextFull):
        _long_chat(ctl, 12)
    assert ctl.set_option("context_overflow", "drop-oldest") == "context_overflow = drop-oldest"
    ctl.send("and now it goes on")
    with pytest.raises(Exception, match="must be one of stop, drop-oldest"):
        ctl.set_option("context_overflow", "truncate")


def test_compact_drops_on_demand_and_the_session_keeps_it(model, tmp_path, xdg_home):
    engine = make_engine(model)
    ctl = make_controller(engine, model, tmp_path, max_tokens=6)
    ctl.new_session("compact")
    _long_chat(ctl, 3)
    assert "drops the oldest turns" in ctl.compact()
    result = ctl.send("after compact")
    assert result.user.context and result.user.context["dropped"]
    assert any("dropped turns #1-" in note for note in result.notes)
    from pagedchat.chat.store import SessionStore

    reloaded = SessionStore(tmp_path).load("compact")
    assert reloaded.tree.path_tokens(reloaded.head) == ctl.session.tree.path_tokens(ctl.session.head)


def test_run_session_stops_by_default_and_drops_when_asked(pagedchat_cli, model):
    args = ["run", "-m", str(model), "--max-context", "120", "--max-tokens", "10", "--temperature", "0",
            "--session", "s"]
    codes = [pagedchat_cli(*args, f"turn {i} has quite a few words in it to fill")[0] for i in range(8)]
    assert 2 in codes, "run --session stops at a full context unless asked"
    code, out, err = pagedchat_cli(*args, "--context-overflow", "drop-oldest", "--json", "one more turn please")
    assert code == 0, err
    code, _, err = pagedchat_cli(*args, "--context-overflow", "sideways", "x")
    assert code == 2 and "--context-overflow must be one of stop, drop-oldest" in err


def test_thirty_turns_with_the_demo_model_stay_correct(tmp_path):
    """The demo model answers in-family questions right all the way through a 30-turn chat (drop-oldest)."""
    from pagedchat.chat.app import start
    from pagedchat.chat.store import SessionStore
    from pagedchat.settings import ModelOptions, SamplingOptions

    ctl, _ = start(ModelOptions(), SamplingOptions(temperature=0), "thirty", False, None, show_progress=False,
                   store=SessionStore(tmp_path))
    questions = {"What is 17 + 25?": "42", "What is the capital of France?": "Paris",
                 "What is 6 * 7?": "42", "What is the capital of Japan?": "Tokyo", "What is 90 - 45?": "45"}
    drops = 0
    for i in range(30):
        question, answer = list(questions.items())[i % len(questions)]
        result = ctl.send(question)
        drops += bool(result.user.context)
        assert answer in result.replies[0].text, (i, result.replies[0].text)
    assert drops >= 2


# -- reasoning models -------------------------------------------------------------------------------------------
def test_split_reasoning_whole_and_streamed():
    from pagedchat.reasoning import ReasoningStream, split

    assert split("<think>\nlet me see\n</think>\n\nIt is 4.") == ("let me see", "It is 4.")
    assert split("It is 4.") == (None, "It is 4.")
    assert split("still thinking", thinking=True) == ("still thinking", "")
    assert split("thought</think>answer") == ("thought", "answer")   # the prompt opened it
    stream, pieces = ReasoningStream(), []
    for ch in "<think>ab</think>cd":
        pieces += stream.feed(ch)
    pieces += stream.flush()
    assert "".join(t for k, t in pieces if k == "reasoning") == "ab"
    assert "".join(t for k, t in pieces if k == "answer") == "cd"
    assert all("<" not in t for _, t in pieces)    # no half tag ever shown


THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and '</think>' in m.content %}{{ m.content.split('</think>')[-1].lstrip() }}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}")


@pytest.fixture
def thinking_model(model, tmp_path):
    """The tiny chat model with a Qwen3-shaped template: the generation prompt opens <think>, and earlier
    turns' reasoning is dropped when the template renders a whole conversation."""
    path = tmp_path / "thinking"
    shutil.copytree(model, path)
    (path / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return path


def test_run_json_puts_reasoning_in_its_own_field(pagedchat_cli, thinking_model):
    code, out, err = pagedchat_cli("run", "-m", str(thinking_model), "--temperature", "0", "--max-tokens", "8",
                                   "--json", "hi")
    assert code == 0, err
    output = json.loads(out)["outputs"][0]
    assert "reasoning" in output and output["reasoning"]
    assert "<think>" not in output["text"] and output["reasoning"] not in output["text"]


def test_repl_collapses_reasoning_once_done_and_think_off_asks_the_template(thinking_model, tmp_path):
    from pagedchat.chat.shell import ChatShell, ChatUI

    ctl = make_controller(make_engine(thinking_model), thinking_model, tmp_path, max_tokens=8)
    ctl.new_session("think")
    console, buffer = text_console()
    shell = ChatShell(ctl, ChatUI(console))
    # a reply that came back with reasoning: collapsed to one line (stored text keeps it token-exact)
    ctl.session.tree.add(None, "user", "q", ctl.templater.encode("<|im_start|>user\nq<|im_end|>\n"))
    view = shell.ui.stream(1)
    view.think = ctl.think_mode()
    with view:
        view.update(0, "<think>\nfirst I add the numbers\n</think>\n\nIt is 4.")
        view.finish(None)
    screen = buffer.getvalue()
    assert "thought: first I add the numbers" in screen and "It is 4." in screen and "<think>" not in screen
    shell.handle("/think off")
    assert ctl.think_mode() == "off" and "enable_thinking false" in buffer.getvalue()
    prompt = ctl.templater.render([{"role": "user", "content": "x"}], True) if ctl.options.apply_think(ctl.session) is None else ""
    assert prompt.endswith("</think>\n\n")


def test_history_keeps_reasoning_ids_token_exact(thinking_model, tmp_path):
    """The template drops earlier reasoning when it renders a whole conversation; the stored branch keeps the
    ids the model produced, and the next turn appends the template's glue and new turn to them."""
    ctl = make_controller(make_engine(thinking_model), thinking_model, tmp_path, max_tokens=8)
    ctl.new_session("exact")
    first = ctl.send("hello")
    reply = first.replies[0]
    history = ctl.session.tree.path_tokens(reply.id)
    second = ctl.send("again")
    prompt = ctl.session.tree.path_tokens(second.user.id)
    assert prompt[:len(history)] == history
    assert ctl.templater.decode(second.user.token_ids).endswith("<|im_start|>user\nagain<|im_end|>\n"
                                                               "<|im_start|>assistant\n<think>\n")
    assert second.stats["prompt_cached"] >= len(history) - 16   # the history came from the pinned KV


def test_a_model_folder_without_a_vocabulary_says_what_is_missing(pagedchat_cli, model, tmp_path):
    broken = tmp_path / "m3"
    shutil.copytree(model, broken)
    (broken / "tokenizer.json").unlink()
    code, out, err = pagedchat_cli("run", "-m", str(broken), "hi")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "no vocabulary file (tokenizer.json, tokenizer.model or vocab.json)" in err


def test_help_lists_version_and_debug_without_type_labels_on_flags(pagedchat_cli):
    code, out, _ = pagedchat_cli("--help")
    assert code == 0 and "--version" in out and "--debug" in out and "<bool>" not in out
    code, out, _ = pagedchat_cli("run", "--help")
    assert code == 0 and "--json" in out and "<bool>" not in out


def test_bench_without_a_model_uses_the_default_demo_model(tmp_path):
    from pagedchat.bench.models import resolve_model

    path, name = resolve_model(None, None, "tiny", tmp_path)
    assert name == "demo" and (path / "config.json").is_file()


def test_server_refuses_an_over_long_chat_unless_the_request_opts_in(model):
    import httpx

    from serve_util import serving_model

    long_chat = []
    for i in range(40):
        long_chat += [{"role": "user", "content": f"question {i} with several more words in it"},
                      {"role": "assistant", "content": f"answer {i} with several more words in it"}]
    long_chat.append({"role": "user", "content": "and the last question"})
    body = {"model": "m", "messages": long_chat, "max_tokens": 4, "temperature": 0}
    with serving_model(model, "m") as (url, engine):
        refused = httpx.post(f"{url}/chat/completions", json=body, timeout=60)
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["code"] == "context_length_exceeded" and str(engine.max_model_len) in error["message"]
        kept = httpx.post(f"{url}/chat/completions", json={**body, "context_overflow": "drop-oldest"}, timeout=60)
        assert kept.status_code == 200, kept.text
        usage = kept.json()["usage"]
        assert usage["prompt_tokens"] + 4 <= engine.max_model_len
        text = httpx.post(f"{url}/completions", timeout=60, json={
            "model": "m", "prompt": [5 + i % 50 for i in range(3 * engine.max_model_len)], "max_tokens": 2,
            "context_overflow": "drop-oldest"})
        assert text.status_code == 200 and text.json()["usage"]["prompt_tokens"] < engine.max_model_len
