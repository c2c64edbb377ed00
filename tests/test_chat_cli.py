"""`run --session/-c`, `chat` on piped input and `sessions ...` through typer's CliRunner."""

import json
import stat

import pytest

from cli_util import invoke, read_session
from pagedchat.errors import UserError


@pytest.fixture
def env(xdg_home):
    return xdg_home


@pytest.fixture
def cli(typer_cli):
    return typer_cli


FAST = ["--temperature", "0", "--max-tokens", "8", "--device", "cpu", "--kv-memory", "4MiB"]


def test_run_session_creates_then_continue_appends(cli, model, env):
    first = cli("run", "-m", model, "--session", "notes", *FAST, "hello world")
    assert first.exit_code == 0, first.output
    data = read_session(env, "notes")
    assert [n["role"] for n in data["nodes"]] == ["user", "assistant"]
    reply = data["nodes"][1]
    assert first.stdout.strip() == reply["text"].strip() and len(reply["token_ids"]) == 8   # stdout: the reply alone
    assert first.stderr.strip() == ("pagedchat: note: the reply was cut at the length limit (--max-tokens): raise "
                                    "it for longer replies")
    assert stat.S_IMODE((env / "data" / "pagedchat" / "sessions" / "notes.json").stat().st_mode) == 0o600

    cli("run", "-m", model, "--session", "other", *FAST, "a b c")  # now "other" is the most recent
    again = cli("run", "--session", "notes", *FAST, "what is 17 + 25?")  # no -m: the session knows its model
    assert again.exit_code == 0, again.output
    follow = cli("run", "-c", *FAST, "--json", "and then?")
    assert follow.exit_code == 0, follow.output
    report = json.loads(follow.stdout)
    assert set(report) >= {"model", "outputs", "usage", "kv", "timing"}
    assert report["session"]["name"] == "notes"  # the most recently used one
    nodes = read_session(env, "notes")["nodes"]
    assert [n["role"] for n in nodes] == ["user", "assistant"] * 3
    assert [n["parent"] for n in nodes] == [None, 1, 2, 3, 4, 5]
    assert report["outputs"][0]["token_ids"] == nodes[-1]["token_ids"]
    history = sum(len(n["token_ids"]) for n in nodes[:-1])
    assert report["usage"]["prompt_tokens"] == history  # the whole exact history, then the new turn


def test_run_session_variants_and_stdin(cli, model, env):
    result = cli("run", "-m", model, "--session", "v", "-n", "3", "--temperature", "1", "--seed", "1",
                 "--max-tokens", "6", "--device", "cpu", "--kv-memory", "4MiB", input="from stdin\n")
    assert result.exit_code == 0, result.output
    assert [line for line in result.output.splitlines() if line.startswith("--- variant")] == \
        ["--- variant 1 (#2) ---", "--- variant 2 (#3) ---", "--- variant 3 (#4) ---"]
    nodes = read_session(env, "v")["nodes"]
    assert nodes[0]["text"] == "from stdin"
    assert [n["variant"] for n in nodes[1:]] == [1, 2, 3] and {n["parent"] for n in nodes[1:]} == {1}


def test_run_session_errors(cli, model, env, capsys, monkeypatch):
    code, out, err = invoke(["run", "-c", "-m", str(model), "hi"], None, capsys, monkeypatch)
    assert code == 2 and "no saved session to continue" in err and "Traceback" not in err
    code, out, err = invoke(["run", "--session", "../x", "-m", str(model), "hi"], None, capsys, monkeypatch)
    assert code == 2 and "invalid session name" in err
    assert cli("run", "-m", model, "--session", "s", "--system", "be brief", *FAST, "hi").exit_code == 0
    assert read_session(env, "s")["nodes"][0]["role"] == "system"
    clash = cli("run", "--session", "s", "--system", "be verbose", *FAST, "hi")
    assert isinstance(clash.exception, UserError) and "different system prompt" in str(clash.exception)


def test_chat_reads_piped_input_and_reopens_sessions(cli, model, env):
    result = cli("chat", "-m", model, "--session", "piped", *FAST,
                 input="hello world\n/fork 2\n/tree\n/set top_k 3\n/exit\n")
    assert result.exit_code == 0, result.output
    assert "variant 2 · #" in result.output and "◀ head" in result.output and "Traceback" not in result.output
    data = read_session(env, "piped")
    assert sorted(n["variant"] for n in data["nodes"] if n["variant"]) == [1, 2]
    assert data["settings"] == {"top_k": 3}
    again = cli("chat", "--session", "piped", *FAST, input="/set\n/show\n")
    assert again.exit_code == 0, again.output
    top_k = next(line for line in again.output.splitlines() if line.strip().startswith("top_k"))
    assert top_k.split() == ["top_k", "3", "session", "piped"]  # saved /set: the session layer now
    assert "#1 you" in again.output and "hello world" in again.output and "(variant 1)" in again.output


def test_sessions_list_show_export_rm(cli, model, env):
    assert cli("run", "-m", model, "--session", "alpha", *FAST, "hello world").exit_code == 0
    assert cli("run", "-m", model, "--session", "beta", *FAST, "a b c").exit_code == 0
    listed = cli("sessions", "list", "--json")
    assert [s["name"] for s in json.loads(listed.output)["sessions"]] == ["beta", "alpha"]
    assert "alpha" in cli("sessions").output
    shown = cli("sessions", "show", "alpha")
    assert shown.exit_code == 0 and "hello world" in shown.output and "#2 assistant" in shown.output
    assert "#1 user" in cli("sessions", "show", "alpha", "--tree").output
    md = cli("sessions", "export", "alpha", "--format", "md")
    assert md.output.startswith("# alpha") and "**User**" in md.output and "hello world" in md.output
    exported = json.loads(cli("sessions", "export", "alpha", "--format", "json").output)
    assert exported == read_session(env, "alpha")
    out = env / "alpha.md"
    assert cli("sessions", "export", "alpha", "-o", out).exit_code == 0 and out.read_text().startswith("# alpha")
    assert cli("sessions", "rm", "alpha").exit_code == 0
    assert [s["name"] for s in json.loads(cli("sessions", "list", "--json").output)["sessions"]] == ["beta"]
    missing = cli("sessions", "rm", "alpha")
    assert isinstance(missing.exception, UserError) and "no session named 'alpha'" in str(missing.exception)
    bad = cli("sessions", "export", "beta", "--format", "txt")
    assert isinstance(bad.exception, UserError)


def test_sessions_list_survives_a_corrupt_file(cli, model, env, capsys, monkeypatch):
    assert cli("run", "-m", model, "--session", "good", *FAST, "hello world").exit_code == 0
    folder = env / "data" / "pagedchat" / "sessions"
    (folder / "broken.json").write_text('{"version": 1, "nodes": [')
    code, out, err = invoke(["sessions", "list"], None, capsys, monkeypatch)
    assert code == 0 and "good" in out and "broken" not in out
    assert err.count("\n") == 1 and "session broken is corrupt" in err and "broken.json.corrupt" in err
    assert (folder / "broken.json.corrupt").exists()


def test_run_session_ctrl_c_saves_the_partial_reply(cli, model, env, monkeypatch):
    import signal

    from pagedchat.engine import Engine

    real_step, steps = Engine.step, []

    def step(self):
        steps.append(1)
        if len(steps) == 4:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C while the reply streams
        return real_step(self)

    monkeypatch.setattr(Engine, "step", step)
    # Greedy: this model's greedy reply runs past 200 tokens, so Ctrl-C always lands mid-reply (a sampled reply
    # could end by itself before step 4, depending on what ran earlier in the process).
    result = cli("run", "-m", model, "--session", "cut", "--temperature", "0", "--max-tokens", "200", "--device",
                 "cpu", "hello world")
    assert result.exit_code == 130
    reply = read_session(env, "cut")["nodes"][1]
    assert reply["interrupted"] is True and 0 < len(reply["token_ids"]) < 10
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
