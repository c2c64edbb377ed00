"""What a new user meets first, on README's commands: stdout holds the reply alone and what to know about it is
one line on stderr (a cut at the length limit, variants that came out identical, Ctrl-C); usage errors are one
line; bad flags are refused before torch loads; tables do not break words at 80 columns."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--device", "cpu", "--kv-memory", "4MiB", "--threads", "1"]


@pytest.fixture
def cli(pagedchat_cli):
    return pagedchat_cli


def _notes(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("pagedchat: note: ")]


def test_a_reply_cut_by_the_context_is_said_on_stderr_for_a_pipe(cli, model):
    code, out, err = cli("run", "-m", str(model), *FAST, "--raw", "--temperature", "0", "--max-context", "12",
                         "hello world")
    assert code == 0 and out.strip(), (code, out, err)
    assert "[length]" not in out and "pagedchat" not in out          # stdout: the reply alone
    assert _notes(err) == ["pagedchat: note: the reply was cut at the length limit (the 12-token context is "
                           "full)"], err


def test_a_reply_cut_by_max_tokens_names_the_flag(cli, model):
    code, out, err = cli("run", "-m", str(model), *FAST, "--raw", "--temperature", "0", "--max-tokens", "3", "hi")
    assert code == 0 and _notes(err) == ["pagedchat: note: the reply was cut at the length limit (--max-tokens 3: "
                                         "raise it for longer replies)"], err
    code, out, err = cli("run", "-m", str(model), *FAST, "--raw", "--max-tokens", "3", "--json", "hi")
    assert code == 0 and not err.strip() and json.loads(out)["outputs"][0]["finish_reason"] == "length"


def test_identical_variants_are_said_to_be_identical(cli, model):
    # top_k 1 leaves one token to sample from: whatever the temperature, every variant is the greedy reply
    code, out, err = cli("run", "-m", str(model), *FAST, "--raw", "-n", "3", "--temperature", "0.8", "--top-k", "1",
                         "--max-tokens", "4", "hello world")
    assert code == 0, err
    assert [line for line in out.splitlines() if line.startswith("---")] == \
        ["--- variant 1 ---", "--- variant 2 ---", "--- variant 3 ---"]
    assert any("all 3 variants are identical" in line for line in _notes(err)), err
    code, out, err = cli("run", "-m", str(model), *FAST, "--raw", "-n", "3", "--temperature", "1", "--seed", "3",
                         "--max-tokens", "6", "hello world")
    assert code == 0 and not any("identical" in line for line in _notes(err)), err


def test_variant_one_streams_and_the_others_print_as_they_finish(capsys):
    from pagedchat.commands.run_output import LiveReply
    from pagedchat.engine import CompletionOutput, RequestOutput

    live = LiveReply(3, None)
    live.feed(0, "abc")
    assert capsys.readouterr().out == "--- variant 1 ---\nabc"           # streamed before anything finished
    live.feed(2, "xyz", "stop")
    assert capsys.readouterr().out == ""                                 # variant 1 still streaming
    live.feed(0, "d", "stop")
    assert capsys.readouterr().out == "d\n--- variant 3 ---\nxyz\n"       # variant 3 finished first: printed next
    live.feed(1, "late", "length")
    assert capsys.readouterr().out == "--- variant 2 ---\nlate\n"
    outputs = [CompletionOutput(i, [1], t, "stop") for i, t in enumerate(["abcd", "late", "xyz"])]
    live.finish(RequestOutput("r", [1], outputs, True, 0, None, None))
    assert capsys.readouterr().out == ""                                 # nothing printed twice


def test_ctrl_c_keeps_what_the_variants_generated(cli, model, monkeypatch):
    from pagedchat.engine.engine import Engine

    real_step, steps = Engine.step, []

    def step(self):
        steps.append(1)
        if len(steps) == 8:     # Ctrl-C in the middle of decoding: the run stops after this step
            signal.raise_signal(signal.SIGINT)
        return real_step(self)

    monkeypatch.setattr(Engine, "step", step)
    code, out, err = cli("run", "-m", str(model), *FAST, "--raw", "-n", "3", "--temperature", "1", "--seed", "1",
                         "--max-tokens", "40", "hello world")
    assert code == 130 and err.strip().endswith("pagedchat: interrupted"), (code, err)
    assert [line for line in out.splitlines() if line.startswith("---")] == \
        ["--- variant 1 ---", "--- variant 2 ---", "--- variant 3 ---"]
    assert len(steps) == 8                                               # it stopped after that step
    assert all(chunk.strip() for chunk in re.split(r"--- variant \d ---", out)[1:]), out   # partial text kept


@pytest.mark.parametrize("args, fragment", [
    (["run", "--temperature", "abc", "hi"], "invalid value for '--temperature'"),
    (["run", "--no-such-flag", "hi"], "no such option: --no-such-flag (see pagedchat run --help)"),
    (["no-such-command"], "no such command 'no-such-command' (see pagedchat --help)"),
])
def test_usage_errors_are_one_line(cli, args, fragment):
    code, out, err = cli(*args)
    assert code == 2 and not out and len(err.strip().splitlines()) == 1, (code, err)
    assert err.startswith("pagedchat: error: ") and fragment in err, err


def test_help_names_types_a_user_can_read(cli):
    code, out, _ = cli("run", "--help")
    assert code == 0 and "list[str]" not in out and "--stop" in out


def test_bad_flags_are_refused_before_torch_loads(tmp_path):
    """One fresh interpreter tries each bad command line; none may import torch (seconds of start-up)."""
    cases = [["--max-tokens", "-5"], ["--block-size", "7"], ["-m", "no-such-model"], ["--kv-memory", "lots"],
             ["--quantize", "int3"], ["--temperature", "-1"], ["--top-p", "2"], ["--dtype", "float8"],
             ["--speculate", "maybe"], ["--context-overflow", "sometimes"]]
    script = f"""
import io, sys
from pagedchat.cli import main
for args in {cases!r}:
    sys.argv, sys.stderr = ["pagedchat", "run", *args, "hi"], io.StringIO()
    try:
        main()
    except SystemExit as e:
        code = e.code
    err, sys.stderr = sys.stderr.getvalue(), sys.__stderr__
    print(args, code, len(err.strip().splitlines()), err.startswith("pagedchat: error: "), "torch" in sys.modules)
"""
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "c"), "XDG_DATA_HOME": str(tmp_path / "d")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    for line, args in zip(out.stdout.splitlines(), cases):
        assert line == f"{args!r} 2 1 True False", line


def test_tables_do_not_break_words_at_80_columns(typer_cli, monkeypatch):
    def words(*args, columns: int) -> set[str]:
        monkeypatch.setenv("COLUMNS", str(columns))
        result = typer_cli(*args)
        assert result.exit_code == 0, result.output
        return {piece for word in result.output.split() for piece in word.split("/") if piece}

    for args in (["models", "list"], ["models", "show", "demo"]):
        wide = words(*args, columns=400)
        assert words(*args, columns=80) <= wide, args        # every word whole (a path may break at a slash)


def test_readme_json_schema_example_runs(cli):
    schema = ROOT / "examples" / "person.json"
    readme = (ROOT / "README.md").read_text()
    assert "examples/person.json" in readme
    json.loads(schema.read_text())
    code, out, err = cli("run", *FAST, "--max-tokens", "120", "--json", "--json-schema", str(schema),
                         "Describe a person")
    assert code == 0, err
    person = json.loads(json.loads(out)["outputs"][0]["text"])
    assert set(person) >= set(json.loads(schema.read_text())["required"])


def test_help_says_how_many_variants_fork_takes(model_dirs):
    from chat_support import text_console
    from pagedchat.chat.shell import ChatShell, ChatUI

    console, buffer = text_console()
    shell = ChatShell.__new__(ChatShell)     # /help needs no model
    ChatShell.__init__(shell, _NoModel(), ChatUI(console))
    shell.handle("/help")
    assert re.search(r"/fork N \[MESSAGE\].*N from 1 to 16", " ".join(buffer.getvalue().split())), buffer.getvalue()


class _NoModel:
    on_note = None
