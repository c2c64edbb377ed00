"""`pagedchat sessions list|show NAME|rm NAME|export NAME --format md|json`: saved chat sessions."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from pagedchat.errors import UserError
from pagedchat.words import counted

sessions_app = typer.Typer(help="Saved chat sessions ($XDG_DATA_HOME/pagedchat/sessions).",
                           invoke_without_command=True)


def register(app: typer.Typer) -> None:
    app.add_typer(sessions_app, name="sessions")


def _console():
    from rich.console import Console

    return Console(highlight=False)


def _warn(lines: list[str]) -> None:
    for line in lines:
        print(f"pagedchat: warning: {line}", file=sys.stderr)


@sessions_app.callback()
def _default(ctx: typer.Context) -> None:
    if ctx.invoked_subcommand is None:
        list_sessions(as_json=False)


@sessions_app.command("list", help="Saved sessions, most recently used first.")
def list_sessions(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    from rich.text import Text

    from pagedchat.chat.render import sessions_view
    from pagedchat.chat.store import SessionStore

    store = SessionStore()
    infos, warnings = store.list()
    _warn(warnings)
    if as_json:
        print(json.dumps({"sessions": [vars(i) for i in infos], "folder": str(store.root)}))
        return
    console = _console()
    if not infos:
        console.print(Text(f"no saved sessions in {store.root}; `pagedchat chat` starts one", style="dim"))
        return
    console.print(sessions_view(infos, {}, None))
    console.print(Text(f"{counted(len(infos), 'session')} in {store.root}", style="dim"))


@sessions_app.command("show", help="A session's details and its current branch (or the whole tree).")
def show_session(name: str = typer.Argument(..., help="Session name."),
                 tree: bool = typer.Option(False, "--tree", help="Show the conversation tree instead."),
                 ) -> None:
    from rich.text import Text

    from pagedchat.chat.render import conversation_view, local_time, tree_view
    from pagedchat.chat.store import SessionStore

    store = SessionStore()
    session = store.load(name)
    console = _console()
    system = f" · system prompt {session.system!r}" if session.system else ""
    console.print(Text(f"session {session.name} · model {session.model} · {counted(session.num_messages, 'message')}, "
                       f"{counted(len(session.tree.leaves()), 'branch', 'branches')} · head #{session.head} · created "
                       f"{local_time(session.created)} · updated {local_time(session.updated)}{system}",
                       style="bold"))
    console.print(Text(str(store.path(name)), style="dim"))
    if tree:
        console.print(tree_view(session))
        return
    path = session.path()
    console.print(conversation_view(path) if path else Text("(no messages on the current branch)", style="dim"))


@sessions_app.command("rm", help="Delete saved sessions.")
def remove_sessions(names: list[str] = typer.Argument(..., help="Session names.")) -> None:
    from pagedchat.chat.store import SessionStore

    store = SessionStore()
    missing = [n for n in names if not store.exists(n)]
    if missing:
        raise UserError(f"no session named {missing[0]!r} in {store.root} (nothing was deleted)")
    for name in names:
        store.remove(name)
        print(f"removed {name}")


@sessions_app.command("export", help="Write a session as Markdown (the current branch, or --all branches) or "
                                     "as its full JSON tree.")
def export_session(name: str = typer.Argument(..., help="Session name."),
                   fmt: str = typer.Option("md", "--format", "-f", help="md or json."),
                   output: Optional[Path] = typer.Option(None, "--output", "-o", help="File (default: stdout)."),
                   all_branches: bool = typer.Option(False, "--all", help="Markdown: every branch, not just the "
                                                                           "current one.")) -> None:
    from pagedchat.chat.render import export_markdown
    from pagedchat.chat.store import SessionStore

    if fmt not in ("md", "json"):
        raise UserError(f"--format must be md or json, got {fmt!r}")
    session = SessionStore().load(name)
    if fmt == "json":
        text = json.dumps(session.to_dict(), ensure_ascii=False, indent=1) + "\n"
    else:
        text = export_markdown(session, all_branches)
    if output is None:
        sys.stdout.write(text)
        return
    try:
        output.write_text(text)
    except OSError as e:
        raise UserError(f"cannot write {output}: {e.strerror}") from None
    print(f"wrote {output}", file=sys.stderr)
