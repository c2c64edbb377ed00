"""Slash commands and turns on top of the controller, printing through a rich Console.

`ChatShell.handle(line)` is everything the REPL does with one line of input; it never raises and never
prints a traceback (a UserError is one red line). `ChatUI` is the terminal-facing part it needs: a console,
live streaming, Ctrl-C catching and (in the real REPL) editing a message in place. Tests drive ChatShell with
a ChatUI on a StringIO console; the prompt-toolkit REPL (repl.py) adds input, history and completion.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass
from typing import Callable

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from pagedchat.chat import render
from pagedchat.chat.alternatives import parse_branch_args
from pagedchat.chat.backend import stop_on_ctrl_c
from pagedchat.chat.controller import MAX_FORK, ChatController, TurnResult
from pagedchat.chat.options import ALL_SET_KEYS
from pagedchat.errors import UserError
from pagedchat.words import article, counted

REFRESH_S = 1 / 12  # live re-render at most this often: markdown rendering is not free


class StreamView:
    """Live view of one reply or of N variants side by side, while tokens arrive.

    While streaming, only the newest lines that fit on the screen are drawn (a live region taller than the
    terminal cannot be redrawn in place and would smear copies into the scrollback); when the reply is
    done the live region is cleared and the whole rendered reply is printed once.
    """

    def __init__(self, console: Console, n: int):
        self.console, self.n = console, n
        self.texts = [""] * n
        self.titles = [f"variant {i + 1}" for i in range(n)]
        self.live = Live(console=console, auto_refresh=False, transient=True, vertical_overflow="crop")
        self.think = "hide"             # /think: how reasoning shows once the reply is done
        self.final = None
        self._last = 0.0

    def view(self, tail: bool = True):
        height = max(4, self.console.height - 3)
        if self.n == 1:
            reply = render.reply_view(self.texts[0], self.think, done=not tail)
            return render.Tail(reply, height) if tail else reply
        side_by_side = self.console.width // self.n >= render.MIN_COLUMN_WIDTH
        per_panel = (height - 2) if side_by_side else max(1, height // self.n - 2)
        return render.variants_view(self.texts, self.titles, self.console.width,
                                    max_lines=per_panel if tail else None, think=self.think)

    def update(self, index: int, text: str) -> None:
        if index >= self.n:
            return
        self.texts[index] = text
        now = time.monotonic()
        if now - self._last >= REFRESH_S:
            self._last = now
            self.live.update(self.view(), refresh=True)

    def finish(self, result: TurnResult | None) -> None:
        """Called once the turn ends (result None: it failed; nothing is printed if nothing streamed)."""
        if result is None and not any(self.texts):
            return
        if result is not None:
            for reply in result.replies:
                i = (reply.variant or 1) - 1
                if i < self.n:
                    self.texts[i] = reply.text
                    self.titles[i] = f"variant {i + 1} · #{reply.id}"
        self.final = self.view(tail=False)

    def __enter__(self):
        self.live.start()
        return self

    def __exit__(self, *exc):
        self.live.stop()
        if self.final is not None:
            self.console.print(self.final)
        return False


class ChatUI:
    """What the shell needs from a terminal. This base version suits tests and piped input."""

    def __init__(self, console: Console | None = None):
        self.console = console or Console()

    def show(self, *renderables) -> None:
        for r in renderables:
            self.console.print(r)

    def error(self, message: str) -> None:
        self.console.print(Text(message, style="bold red"))

    def note(self, message: str) -> None:
        self.console.print(Text(message, style="yellow"))

    def stream(self, n: int) -> StreamView:
        return StreamView(self.console, n)

    def ask_edit(self, default: str) -> str | None:
        """Let the user edit a message in place; None when this UI cannot (the text must be given)."""
        return None

    def clear_screen(self) -> None:
        self.console.clear()

    def interruptible(self, ctl: ChatController):
        return stop_on_ctrl_c(ctl.backend)


@dataclass
class Command:
    name: str
    usage: str
    summary: str
    run: Callable[["ChatShell", str], None]
    aliases: tuple[str, ...] = ()
    saves: bool = False         # changes the session without a turn: autosave after it


class ChatShell:
    def __init__(self, ctl: ChatController, ui: ChatUI):
        self.ctl, self.ui = ctl, ui
        ctl.on_note = ui.note       # notes known before a reply (sampling changed, turns dropped) come first
        self.running = True
        self.commands: dict[str, Command] = {}
        for cmd in _COMMANDS:
            for name in (cmd.name, *cmd.aliases):
                self.commands[name] = cmd

    # -- one line of input ----------------------------------------------------------------------------------
    def handle(self, line: str) -> None:
        try:
            self._handle(line)
        except UserError as e:
            self.ui.error(str(e))
        except Exception as e:  # a bug must not kill the REPL or spill a traceback on the user's screen
            if os.environ.get("PAGEDCHAT_DEBUG") == "1":
                self.ui.console.print(traceback.format_exc(), markup=False, highlight=False)
            self.ui.error(f"internal error: {type(e).__name__}: {e}")

    def _handle(self, line: str) -> None:
        text = unwrap_block(line)
        stripped = text.strip()
        if not stripped:
            return
        if stripped.startswith("/") and not stripped.startswith("//"):
            name, _, args = stripped.partition(" ")
            cmd = self.commands.get(name.lower())
            if cmd is None:
                close = [c for c in sorted({c.name for c in _COMMANDS}) if c.startswith(name.lower()[:3])]
                hint = f"; did you mean {', '.join(close)}?" if close else ""
                raise UserError(f"unknown command {name}{hint} (/help lists them; start a message with // "
                                f"to send a literal slash)")
            cmd.run(self, args.strip())
            error = self.ctl.autosave() if cmd.saves else None
            if error:
                self.ui.error(error)
            return
        if stripped.startswith("//"):
            text = text.replace("//", "/", 1)
        self.turn(lambda on_update: self.ctl.send(text, on_update=on_update), 1)

    def turn(self, run: Callable, n: int) -> TurnResult | None:
        """Run a generating action with live output, then the notes, the stats line and any save error."""
        view = self.ui.stream(n)
        view.think = self.ctl.think_mode()
        result = None
        with self.ui.interruptible(self.ctl), view:
            try:
                result = run(view.update)
            finally:
                view.finish(result)
        ids = [r.id for r in result.replies]
        if result.interrupted:
            kept = ", ".join(f"#{i}" for i in ids) or "nothing"
            self.ui.note(f"interrupted: the partial reply is kept as {kept} (marked interrupted)")
        for note in result.notes:
            self.ui.note(note)
        cut = [f"#{r.id}" for r in result.replies if r.finish_reason == "length" and not r.interrupted]
        if cut and result.stats.get("capped_max_tokens") is None:
            self.ui.show(Text(f"[length] {' '.join(cut)} stopped at max_tokens (/set max_tokens N for longer "
                              f"replies)", style="dim"))
        if self.ctl.logprobs_on():
            for reply in result.replies:
                if reply.logprobs:
                    self.ui.show(render.alternatives_view(reply, self.ctl.templater.decode))
        self.ui.show(render.stats_line(result.stats, ids))
        if len(ids) > 1:
            self.ui.note(f"continuing from variant 1 (#{ids[0]}); /pick K continues from variant K")
        if result.save_error:
            self.ui.error(result.save_error)
        return result


def unwrap_block(text: str) -> str:
    """A message typed as a \"\"\"-block loses its quotes."""
    s = text.strip()
    if s.startswith('"""'):
        s = s[3:]
        if s.endswith('"""'):
            s = s[:-3]
        return s.strip("\n")
    return text


def _node_id(arg: str, usage: str) -> int:
    word = arg.split(maxsplit=1)[0] if arg.strip() else ""
    try:
        return int(word.lstrip("#"))
    except ValueError:
        raise UserError(f"usage: {usage} (node ids are shown by /tree)") from None


def _count(arg: str, usage: str, low: int, high: int) -> int:
    try:
        n = int(arg)
    except ValueError:
        raise UserError(f"usage: {usage}") from None
    if not low <= n <= high:
        raise UserError(f"usage: {usage} (N from {low} to {high})")
    return n


# -- the commands ---------------------------------------------------------------------------------------------
def _help(shell: ChatShell, arg: str) -> None:
    if arg:
        cmd = shell.commands.get(arg if arg.startswith("/") else "/" + arg)
        if cmd is None:
            raise UserError(f"no command {arg}; /help lists them")
        shell.ui.show(Text(cmd.usage, style="bold"), Text(cmd.summary))
        if cmd.aliases:
            shell.ui.show(Text(f"also: {', '.join(cmd.aliases)}", style="dim"))
        return
    table = Table(box=None, padding=(0, 2), show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for cmd in _COMMANDS:
        table.add_row(cmd.usage, cmd.summary.splitlines()[0])
    shell.ui.show(table, Text('Enter sends; Esc-Enter or Alt-Enter adds a line; """ starts a block that ends with '
                              '""". Ctrl-C stops a reply (kept, marked interrupted); Ctrl-D exits. '
                              "Up/Ctrl-R search history; Tab completes commands.", style="dim"))


def _exit(shell: ChatShell, arg: str) -> None:
    shell.running = False


def _no_args(arg: str, usage: str) -> None:
    if arg:
        raise UserError(f"usage: {usage}")


def _new(shell: ChatShell, arg: str) -> None:
    session = shell.ctl.new_session(arg or None)
    shell.ui.note(f"new session {session.name} (saved after its first turn; the others stay in the pool)")


def _sessions(shell: ChatShell, arg: str) -> None:
    _no_args(arg, "/sessions")
    infos, warnings = shell.ctl.store.list()
    for w in warnings:
        shell.ui.error(w)
    shell.ui.show(render.sessions_view(infos, shell.ctl.sessions, shell.ctl.current.name if shell.ctl.current
                                       else None))
    shell.ui.show(Text("* current  ● resident in this pool", style="dim"))


def _open(shell: ChatShell, arg: str) -> None:
    if not arg or " " in arg:
        raise UserError("usage: /open NAME (/sessions lists them)")
    session, _ = shell.ctl.open_session(arg)
    shell.ui.note(f"session {session.name}: {counted(session.num_messages, 'message')}, "
                  f"{counted(len(session.tree.leaves()), 'branch', 'branches')}")
    tail = session.path()[-4:]
    if tail:
        shell.ui.show(render.conversation_view(tail))


def _save(shell: ChatShell, arg: str) -> None:
    if " " in arg:
        raise UserError("usage: /save [NAME]")
    path = shell.ctl.save(arg or None)
    shell.ui.note(f"saved {shell.ctl.session.name} to {path}")


def _tree(shell: ChatShell, arg: str) -> None:
    _no_args(arg, "/tree")
    shell.ui.show(render.tree_view(shell.ctl.session))


def _show(shell: ChatShell, arg: str) -> None:
    _no_args(arg, "/show")
    path = shell.ctl.session.path()
    shell.ui.show(render.conversation_view(path) if path else Text("(no messages on this branch yet)", style="dim"))


def _switch(shell: ChatShell, arg: str) -> None:
    usage = "/switch ID"
    node = shell.ctl.switch(_node_id(arg, usage))
    shell.ui.note(f"head is now #{node.id} ({node.role})")
    shell.ui.show(render.conversation_view(shell.ctl.session.path()[-2:]))
    if node.role == "user":
        shell.ui.note("this message has no reply on this branch: /regen answers it")


def _regen(shell: ChatShell, arg: str) -> None:
    _no_args(arg, "/regen")
    shell.turn(lambda on_update: shell.ctl.regen(on_update=on_update), 1)


def _edit(shell: ChatShell, arg: str) -> None:
    usage = "/edit ID [NEW TEXT]"
    node_id = _node_id(arg, usage)
    node = shell.ctl.session.node(node_id)
    if node.role != "user":
        raise UserError(f"#{node_id} is {article(node.role)} message; /edit changes user messages (/regen for "
                        f"replies, /system for the system prompt)")
    parts = arg.split(maxsplit=1)
    text = parts[1] if len(parts) > 1 else shell.ui.ask_edit(node.text)
    if text is None:
        raise UserError(f"usage: {usage} (here the new text must follow the id)")
    text = unwrap_block(text)
    shell.turn(lambda on_update: shell.ctl.edit(node_id, text, on_update=on_update), 1)


def _fork(shell: ChatShell, arg: str) -> None:
    _side_by_side(shell, arg, "/fork N [MESSAGE]", shell.ctl.fork)


def _beam(shell: ChatShell, arg: str) -> None:
    _side_by_side(shell, arg, "/beam W [MESSAGE]", shell.ctl.beam)


def _side_by_side(shell: ChatShell, arg: str, usage: str, action: Callable) -> None:
    """/fork N and /beam W: a count, then an optional message; the N replies shown side by side."""
    parts = arg.split(maxsplit=1)
    if not parts:
        raise UserError(f"usage: {usage}")
    n = _count(parts[0], usage, 1, MAX_FORK)
    text = unwrap_block(parts[1]) if len(parts) > 1 else None
    shell.turn(lambda on_update: action(n, text, on_update=on_update), n)


def _pick(shell: ChatShell, arg: str) -> None:
    usage = "/pick K"
    try:
        k = int(arg)
    except ValueError:
        raise UserError(f"usage: {usage}") from None
    node = shell.ctl.pick(k)
    shell.ui.note(f"continuing from variant {k} (#{node.id})")


def _system(shell: ChatShell, arg: str) -> None:
    if not arg:
        current = shell.ctl.session.system
        shell.ui.show(Text(f"system prompt: {current!r}" if current else "no system prompt"))
        return
    shell.ui.note(shell.ctl.set_system(None if arg == "--clear" else unwrap_block(arg)))


def _set(shell: ChatShell, arg: str) -> None:
    if not arg:
        params, sources = shell.ctl.sampling()
        shell.ui.show(render.settings_view(params, sources, {"context_overflow": shell.ctl.overflow_policy()}))
        return
    key, _, value = arg.partition(" ")
    if not value.strip():
        if key not in ALL_SET_KEYS:
            raise UserError(f"unknown setting {key!r}; keys: {', '.join(ALL_SET_KEYS)}")
        raise UserError(f"usage: /set {key} VALUE (or /set {key} default)")
    shell.ui.note(shell.ctl.set_option(key, value))


def _stats(shell: ChatShell, arg: str) -> None:
    _no_args(arg, "/stats")
    shell.ui.show(render.pool_view(shell.ctl.pool_stats(), shell.ctl.current.name if shell.ctl.current else None))


def _think(shell: ChatShell, arg: str) -> None:
    if not arg:
        shell.ui.show(Text(f"think {shell.ctl.think_mode()} (/think show|hide|off)"))
        return
    shell.ui.note(shell.ctl.set_think(arg.strip().lower()))


def _logprobs(shell: ChatShell, arg: str) -> None:
    if arg:
        shell.ui.note(shell.ctl.set_logprobs(arg.strip().lower()))
        return
    head = shell.ctl.session.head_node()
    state = "on" if shell.ctl.logprobs_on() else "off"
    if head is None or head.role != "assistant" or not head.logprobs:
        shell.ui.show(Text(f"logprobs {state}; the head is not a reply with stored alternatives (/logprobs on, "
                           f"then a reply keeps them)"))
        return
    shell.ui.show(render.alternatives_view(head, shell.ctl.templater.decode, every=True))


def _branch(shell: ChatShell, arg: str) -> None:
    index, word = parse_branch_args(arg, "/branch TOKEN_INDEX ALTERNATIVE")
    shell.turn(lambda on_update: shell.ctl.branch(index, word, on_update=on_update), 1)


def _compact(shell: ChatShell, arg: str) -> None:
    _no_args(arg, "/compact")
    shell.ui.note(shell.ctl.compact())


def _clear(shell: ChatShell, arg: str) -> None:
    _no_args(arg, "/clear")
    shell.ctl.clear()
    shell.ui.clear_screen()
    shell.ui.note("new conversation: the next message starts from the top (earlier turns stay in /tree)")


_COMMANDS = [
    Command("/help", "/help [COMMAND]", "Show the commands, or one command's help.", _help, ("/?",)),
    Command("/exit", "/exit", "Leave (the session is already saved). Ctrl-D does the same.", _exit,
            ("/quit", "/bye")),
    Command("/new", "/new [NAME]", "Start a new session; the current one stays resident in the same pool.", _new),
    Command("/sessions", "/sessions", "List saved sessions (* current, ● resident in this pool).", _sessions),
    Command("/open", "/open NAME", "Make session NAME current (loaded from disk if not resident).", _open),
    Command("/save", "/save [NAME]", "Save now (every turn autosaves); with NAME, save under a new name and "
                                     "keep going there.", _save),
    Command("/tree", "/tree", "Show the conversation tree: node ids, roles, first words, tokens; the current "
                              "branch in bold, the head marked.", _tree),
    Command("/show", "/show", "Print the current branch as a transcript.", _show),
    Command("/switch", "/switch ID", "Move the head to node ID; the next message continues from there and "
                                     "reuses the cached KV of the shared prefix.", _switch, saves=True),
    Command("/regen", "/regen", "A new reply to the last message, as a sibling: the old reply stays in the "
                                "tree.", _regen),
    Command("/edit", "/edit ID [NEW TEXT]", "Change an earlier user message: a sibling branch with the new "
                                            "text is answered; the original branch stays.\nWithout NEW TEXT "
                                            "the message opens for editing.", _edit),
    Command("/fork", "/fork N [MESSAGE]", f"N variants (N from 1 to {MAX_FORK}) generated in parallel as forks of "
                                          "one sequence (one prefill), side by side: of MESSAGE's reply, or new "
                                          "variants of the last reply. Then /pick K.", _fork),
    Command("/beam", "/beam W [MESSAGE]", f"Beam search with W beams (W from 1 to {MAX_FORK}) sharing blocks "
                                          "copy-on-write: the W hypotheses, best first, side by side with their "
                                          "scores (of MESSAGE's reply, or of the last message again). Then /pick K.",
            _beam),
    Command("/pick", "/pick K", "Continue from variant K of the last /fork or /beam (the others stay in the "
                                "tree).", _pick, saves=True),
    Command("/system", "/system [TEXT|--clear]", "Show or set the system prompt; a new one starts a new "
                                                 "branch from the top.", _system, saves=True),
    Command("/set", "/set [KEY VALUE]", f"Show settings and their sources, or set one of: {', '.join(ALL_SET_KEYS)} "
                                        f"(VALUE 'default' removes the override).", _set, saves=True),
    Command("/stats", "/stats", "KV pool: blocks used/free/cached/shared, prefix-hit rate, pins, blocks per "
                                "session.", _stats),
    Command("/think", "/think [show|hide|off]", "Reasoning models (<think>...</think>): show the reasoning in "
                                                "full, hide it (one dim line once the reply is done; default), or "
                                                "off (ask the template not to think).", _think, saves=True),
    Command("/logprobs", "/logprobs [on|off]", "on: each reply keeps its tokens' probabilities and up to 4 "
                                               "alternatives, and lists where the model hesitated; alone: every "
                                               "token of the head reply.", _logprobs, saves=True),
    Command("/branch", "/branch TOKEN_INDEX ALTERNATIVE", "A sibling of the head reply that keeps its first "
                                                           "TOKEN_INDEX tokens, takes ALTERNATIVE (a rank from "
                                                           "/logprobs, or a token's text, quoted if it has spaces) "
                                                           "next and goes on; the shared prefix costs nothing.",
            _branch),
    Command("/compact", "/compact", "Drop the oldest turns of this branch from the context at the next "
                                    "message (they stay in the tree); a branch that outgrows the context does "
                                    "this by itself under context_overflow drop-oldest.", _compact),
    Command("/clear", "/clear", "Clear the screen and start a fresh conversation in this session (nothing is "
                                "deleted).", _clear, saves=True),
]

COMMAND_NAMES = sorted({name for c in _COMMANDS for name in (c.name, *c.aliases)})
