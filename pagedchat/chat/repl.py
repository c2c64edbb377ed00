"""The interactive shell: prompt-toolkit input on top of ChatShell.

Persistent history (up-arrow, Ctrl-R), Esc-Enter / Alt-Enter for a new line, bracketed paste, \"\"\"-blocks,
Tab completion of slash commands and their arguments, a bottom toolbar with the session and the pool.
prompt-toolkit is imported here only, when the REPL starts (machines without it can still `run`).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager, nullcontext

from rich.console import Console
from rich.text import Text

from pagedchat.chat import render
from pagedchat.chat.controller import ChatController
from pagedchat.chat.options import ALL_SET_KEYS, THINK_MODES
from pagedchat.chat.shell import COMMAND_NAMES, ChatShell, ChatUI
from pagedchat.errors import UserError
from pagedchat.words import counted


def open_block(text: str) -> bool:
    """True while a \"\"\"-block is still open: Enter then adds a line instead of sending."""
    s = text.strip()
    return s.startswith('"""') and (s == '"""' or s.count('"""') == 1)


def banner(ctl: ChatController) -> Text:
    s = ctl.session
    pool = ctl.backend.pool_stats()
    state = (f"{counted(s.num_messages, 'message')}, {counted(len(s.tree.leaves()), 'branch', 'branches')}" if s.tree.nodes else "new")
    text = Text()
    text.append("pagedchat", style="bold")
    remote = ctl.backend.describe()
    where = (f"server {remote['server']} ({remote['endpoint']})" if remote else
             f"KV pool {pool.num_blocks} blocks × {pool.block_size} tokens")
    text.append(f" · model {ctl.entry.name} · session {s.name} ({state}) · {where} · context "
                f"{ctl.backend.max_model_len}\n", style="dim")
    text.append("/help lists commands · Enter sends, Esc-Enter adds a line · Ctrl-C stops a reply · Ctrl-D exits",
                style="dim")
    return text


class PromptUI(ChatUI):
    def __init__(self, console: Console, prompt_session, terminal: bool = False):
        super().__init__(console)
        self.prompt_session = prompt_session
        self.terminal = terminal

    @contextmanager
    def interruptible(self, ctl: ChatController):
        # While a reply streams the terminal does not echo keys: an echoed "^C" would shift the live view.
        with super().interruptible(ctl), (_no_echo() if self.terminal else nullcontext()):
            yield

    def ask_edit(self, default: str) -> str | None:
        try:
            return self.prompt_session.prompt("edit> ", default=default)
        except (KeyboardInterrupt, EOFError):
            raise UserError("edit cancelled") from None


@contextmanager
def _no_echo():
    try:
        import termios

        fd = sys.stdin.fileno()
        saved = termios.tcgetattr(fd)
    except (ImportError, OSError, ValueError):
        yield
        return
    quiet = list(saved)
    quiet[3] &= ~(termios.ECHO | getattr(termios, "ECHOCTL", 0))
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)


def _completer(shell: ChatShell):
    from prompt_toolkit.completion import Completer, Completion

    class SlashCompleter(Completer):
        def get_completions(self, document, complete_event):
            text = document.text_before_cursor
            if not text.startswith("/") or "\n" in text:
                return
            if " " not in text:
                for name in COMMAND_NAMES:
                    if name.startswith(text.lower()):
                        takes_args = " " in shell.commands[name].usage
                        yield Completion(name + (" " if takes_args else ""), -len(text), display=name)
                return
            command, _, arg = text.partition(" ")
            if " " in arg:
                return
            for option in self._arguments(command.lower()):
                if option.startswith(arg):
                    yield Completion(option, -len(arg))

        def _arguments(self, command: str) -> list[str]:
            ctl = shell.ctl
            if command == "/open":
                return sorted(set(ctl.store.names()) | set(ctl.sessions))
            if command in ("/switch", "/edit") and ctl.current is not None:
                nodes = ctl.session.tree.nodes.values()
                return [str(n.id) for n in nodes if command == "/switch" or n.role == "user"]
            if command == "/set":
                return list(ALL_SET_KEYS)
            if command == "/help":
                return [n.lstrip("/") for n in COMMAND_NAMES]
            if command == "/logprobs":
                return ["on", "off"]
            if command == "/think":
                return list(THINK_MODES)
            if command == "/pick" and ctl.current is not None:
                return [str(k) for k in range(1, len(ctl.session.last_fork) + 1)]
            return []

    return SlashCompleter()


def _key_bindings():
    from prompt_toolkit.filters import is_searching
    from prompt_toolkit.key_binding import KeyBindings

    kb = KeyBindings()

    @kb.add("enter", filter=~is_searching)  # while Ctrl-R searching, Enter keeps its own meaning
    def _enter(event):
        buffer = event.current_buffer
        if open_block(buffer.text):
            buffer.insert_text("\n")
        else:
            buffer.validate_and_handle()

    @kb.add("escape", "enter", filter=~is_searching)  # Esc-Enter; terminals send Alt-Enter as the same two keys
    def _newline(event):
        event.current_buffer.insert_text("\n")

    return kb


def _toolbar(ctl: ChatController):
    def toolbar():
        try:
            s, pool = ctl.session, ctl.backend.pool_stats()
            head = f"#{s.head}" if s.head is not None else "new branch"
            context = len(s.tree.path_tokens(s.head))
            where = "remote" if ctl.backend.describe() else f"KV {pool.used}/{pool.num_blocks} blocks"
            return (f" {s.name} · {ctl.entry.name} · head {head} · ctx {context}/{ctl.backend.max_model_len} · "
                    f"{where} · /help ")
        except Exception:
            return " pagedchat "
    return toolbar


def run_repl(ctl: ChatController, console: Console | None = None, pt_input=None, pt_output=None,
             history_path=None) -> int:
    """The read-eval-print loop; returns the exit code. pt_input/pt_output: prompt-toolkit pipe input and
    (dummy) output for tests; without them, a non-terminal stdin falls back to plain line reading."""
    console = console or Console(highlight=False)
    if pt_input is None and not sys.stdin.isatty():
        return _run_plain(ctl, console)
    try:
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory, InMemoryHistory
    except ImportError:
        console.print(Text("prompt-toolkit is not installed: plain input (no history file, completion or "
                           "multi-line editing; \"\"\"-blocks still work)", style="yellow"))
        console.print(banner(ctl))
        return _run_plain(ctl, console, prompt=">>> ")

    from pagedchat.chat.store import history_file

    if history_path is None:
        try:
            history = FileHistory(str(history_file()))
        except OSError as e:
            console.print(Text(f"input history not kept: {e.strerror}", style="yellow"))
            history = InMemoryHistory()
    else:
        history = FileHistory(str(history_path))
    session = PromptSession(history=history, key_bindings=_key_bindings(), complete_while_typing=False,
                            prompt_continuation=lambda width, line, wrap: "... ".rjust(width),
                            bottom_toolbar=_toolbar(ctl), input=pt_input, output=pt_output)
    shell = ChatShell(ctl, PromptUI(console, session, terminal=pt_input is None))
    session.completer = _completer(shell)
    console.print(banner(ctl))
    _show_context(ctl, console)
    while shell.running:
        try:
            line = session.prompt(">>> ")
        except KeyboardInterrupt:
            continue  # Ctrl-C at the prompt clears the line, like a shell
        except EOFError:
            break
        try:
            shell.handle(line)
        except KeyboardInterrupt:  # Ctrl-C outside a streaming reply (a table being printed, a save)
            console.print(Text("interrupted", style="yellow"))
    return 0


def _run_plain(ctl: ChatController, console: Console, prompt: str | None = None) -> int:
    """Line by line from stdin (a pipe, a file, or a terminal without prompt-toolkit): one message or
    command per line; \"\"\"-blocks span lines."""
    shell = ChatShell(ctl, ChatUI(console))
    pending: list[str] = []
    while shell.running:
        try:
            line = input(prompt if not pending else "... ") if prompt is not None else sys.stdin.readline()
        except KeyboardInterrupt:
            pending = []
            console.print()
            continue
        except EOFError:
            break
        if prompt is None:
            if not line:
                break
            line = line.rstrip("\n")
        if pending or open_block(line):
            pending.append(line)
            if open_block("\n".join(pending)):
                continue
            line, pending = "\n".join(pending), []
        shell.handle(line)
    if pending and shell.running:
        shell.handle("\n".join(pending))
    return 0


def _show_context(ctl: ChatController, console: Console) -> None:
    """When resuming a session, show where the conversation stands."""
    tail = ctl.session.path()[-4:]
    if tail and any(n.role != "system" for n in tail):
        console.print(Text("… current branch:", style="dim"))
        console.print(render.conversation_view(tail))
