"""Rich renderables for the chat: replies, side-by-side variants, the stats line, the tree, tables.

Model text is always wrapped in Text/Markdown objects, never interpolated into console markup, so a reply
containing "[bold]" or "[/]" prints as written; and its control characters are shown, not acted on
(words.for_terminal), so a reply containing an escape sequence cannot move the cursor.
"""

from __future__ import annotations

import math
from datetime import datetime

from rich.console import Group
from rich.markdown import Markdown
from rich.segment import Segment
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from rich.tree import Tree as RichTree

from pagedchat.chat import alternatives
from pagedchat.reasoning import split as split_reasoning
from pagedchat.chat.session import Session
from pagedchat.chat.tree import Node
from pagedchat.words import for_terminal

MIN_COLUMN_WIDTH = 28


def reply_view(text: str, think: str = "hide", done: bool = True):
    """A reply as Markdown; reasoning (<think>...</think>) dim above it: in full while it streams or under
    /think show, else collapsed to one line once the reply is done."""
    reasoning, answer = split_reasoning(for_terminal(text))
    body = Markdown(answer) if answer.strip() else Text("…", style="dim")
    if reasoning is None:
        return body
    if done and think != "show":
        line = Text(f"thought: {first_words(reasoning, 72)} ({len(reasoning.split())} words; /think show)",
                    style="dim italic")
    else:
        line = Text(reasoning, style="dim italic")
    return Group(line, body) if answer.strip() or not done else line


class Tail:
    """The last `max_lines` lines of a renderable (the newest text of a reply still streaming)."""

    def __init__(self, renderable, max_lines: int):
        self.renderable, self.max_lines = renderable, max_lines

    def __rich_console__(self, console, options):
        lines = console.render_lines(self.renderable, options, pad=False)
        for line in lines[-self.max_lines:]:
            yield from line
            yield Segment.line()


def variants_view(texts: list[str], titles: list[str], width: int, max_lines: int | None = None,
                  think: str = "hide"):
    """Variants side by side when each column gets a readable width, else stacked panels. With
    max_lines, each panel shows only its newest lines (while streaming)."""
    def body(text):
        view = reply_view(text, think, done=max_lines is None)
        return Tail(view, max_lines) if max_lines else view

    panels = [Panel(body(t), title=title, title_align="left", border_style="cyan")
              for t, title in zip(texts, titles)]
    if len(panels) > 1 and width // len(panels) >= MIN_COLUMN_WIDTH:
        grid = Table.grid(expand=True, padding=(0, 1))
        for _ in panels:
            grid.add_column(ratio=1)
        grid.add_row(*panels)
        return grid
    return Group(*panels)


def _seconds(value) -> str:
    return f"{value:.2f}s" if value is not None else "-"


def stats_line(stats: dict, node_ids: list[int] | None = None) -> Text:
    """One dim line after each reply: prompt tokens new vs served from cache, TTFT, tokens/s, KV blocks."""
    parts = [" ".join(f"#{i}" for i in node_ids)] if node_ids else []
    remote = stats.get("remote")
    if remote and remote.get("cached_tokens") is None:   # vLLM reports it only with --enable-prompt-tokens-details
        parts.append(f"prompt {stats.get('prompt_tokens', 0)} (cached: not reported by the server)")
    else:
        parts.append(f"prompt {stats.get('prompt_new', 0)} new + {stats.get('prompt_cached', 0)} cached")
    parts.append(f"TTFT {_seconds(stats.get('ttft_s'))}")
    tps = stats.get("tokens_per_s")
    parts.append(f"{tps:.1f} tok/s" if tps else "- tok/s")
    variants = stats.get("variants", 1)
    parts.append(f"{stats.get('completion_tokens', 0)} tok" + (f" ({variants} variants)" if variants > 1 else ""))
    if remote:     # the server's own prefix cache did what the pool does locally
        parts.append(f"server {remote['server']}" + (f" (history {remote['history']})"
                                                      if remote["history"] != "token-exact" else ""))
    else:
        parts.append(f"KV {stats.get('blocks_used', 0)}/{stats.get('num_blocks', 0)} blocks")
    return Text(" · ".join(parts), style="dim")


def _percent(logprob: float) -> str:
    p = math.exp(logprob) * 100
    return f"{p:.0f}%" if p >= 1 else "<1%"


def alternatives_view(node: Node, decode, every: bool = False) -> Text:
    """A reply's tokens with their alternatives, dim, one line per token: only where the model chose with
    less than alternatives.SURE (compact, after each reply), or every token (/logprobs with no argument).
    Each alternative has its rank, so `/branch INDEX RANK` continues from it."""
    rows = node.logprobs or []
    listed = [i for i, row in enumerate(rows) if every or alternatives.is_hesitant(row)]
    out = Text(style="dim")
    if not listed:
        out.append(f"#{node.id}: every token chosen with at least {alternatives.SURE:.0%} "
                   f"(/logprobs lists them all)")
        return out
    out.append(f"#{node.id} {'tokens' if every else 'where the model hesitated'} "
               f"(index  token  probability · alternatives; /branch INDEX RANK|TEXT):")
    for i in listed:
        chosen = node.token_ids[i]
        out.append(f"\n{i:>5}  {decode([chosen])!r} {_percent(rows[i][0])}")
        for rank, (token, logprob) in enumerate(alternatives.others(rows[i], chosen), 1):
            out.append(f"  · {rank} {decode([token])!r} {_percent(logprob)}")
    return out


def first_words(text: str, limit: int = 48) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def node_label(node: Node, on_path: bool, is_head: bool) -> Text:
    style = "bold" if on_path else ""
    role_style = {"user": "green", "assistant": "cyan", "system": "magenta"}[node.role]
    label = Text()
    label.append(f"#{node.id} ", style=style + " yellow" if on_path else "yellow")
    label.append(node.role, style=f"{role_style} {style}".strip())
    if node.variant is not None:
        label.append(f" v{node.variant}", style="cyan")
    label.append(f" “{first_words(for_terminal(node.text)) or '…'}”", style=style)
    label.append(f" ({len(node.token_ids)} tok)", style="dim")
    if node.interrupted:
        label.append(" [interrupted]", style="red")
    elif node.finish_reason == "length":
        label.append(" [length]", style="dim")
    if is_head:
        label.append("  ◀ head", style="bold reverse")
    return label


def tree_view(session: Session) -> RichTree:
    on_path = {n.id for n in session.path()}
    root = RichTree(Text(f"session {session.name}", style="bold"), guide_style="dim")

    def add(parent_view, node_id):
        for child in session.tree.children(node_id):
            view = parent_view.add(node_label(child, child.id in on_path, child.id == session.head))
            add(view, child.id)

    add(root, None)
    if not session.tree.nodes:
        root.add(Text("(empty)", style="dim"))
    elif session.head is None:
        root.add(Text("◀ head: a new conversation starts with the next message", style="bold"))
    return root


def conversation_view(nodes: list[Node]):
    """A path of messages, one after the other, as in a chat transcript."""
    items = []
    for node in nodes:
        who = {"user": ("you", "green"), "assistant": ("assistant", "cyan"), "system": ("system", "magenta")}
        name, color = who[node.role]
        header = Text(f"#{node.id} {name}", style=f"bold {color}")
        if node.variant is not None:
            header.append(f" (variant {node.variant})", style="cyan")
        if node.interrupted:
            header.append(" [interrupted]", style="red")
        elif node.finish_reason == "length":
            header.append(" [length]", style="dim")
        items += [header, reply_view(node.text) if node.role == "assistant" else Text(for_terminal(node.text)),
                  Text("")]
    return Group(*items)


def pool_view(stats: dict, current: str | None) -> Group:
    if stats.get("remote"):
        return remote_view(stats)
    table = Table(title="KV pool", show_header=False, title_justify="left", box=None, padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    total = stats["num_blocks"]
    table.add_row("blocks", f"{total} × {stats['block_size']} tokens" +
                  (f", KV stored as {stats['kv_dtype']}" if stats.get("kv_dtype") else ""))
    table.add_row("used", f"{stats['used']} ({stats['used'] / total:.1%}), peak {stats['peak_used']}")
    table.add_row("free", f"{stats['free']} (of which {stats['cached']} still cached for prefix hits)")
    table.add_row("shared", f"{stats['shared']} blocks with refcount > 1")
    table.add_row("prefix cache", f"{stats['prefix_hit_rate']:.1%} hit rate "
                                  f"({stats['prefix_hit_tokens']} of {stats['prefix_query_tokens']} prompt tokens)")
    table.add_row("lower tiers", f"{stats['ram_hit_tokens']} of the hit tokens loaded from RAM, "
                                 f"{stats['disk_hit_tokens']} from disk")
    table.add_row("copy-on-write", f"{stats['cow_copies']} block copies")
    table.add_row("pins", f"{stats['pinned']} branch heads holding {stats['pinned_blocks']} blocks")
    table.add_row("preemptions", str(stats["preemptions"]))
    if stats.get("spec"):
        spec = stats["spec"]
        table.add_row("speculation", f"{spec['method']}: {spec['accepted_tokens']} of {spec['proposed_tokens']} "
                                     f"draft tokens accepted ({spec['acceptance_rate']:.1%}), "
                                     f"{spec['tokens_per_step']:.2f} tokens per decode step")
    sessions = Table(title="sessions in this pool", title_justify="left", box=None, padding=(0, 2))
    for column in ("session", "nodes", "pinned heads", "blocks held"):
        sessions.add_column(column)
    for name, s in stats["sessions"].items():
        sessions.add_row(name + (" *" if name == current else ""), str(s["nodes"]), str(s["pinned_heads"]),
                         str(s["blocks"]))
    parts = [table, Text(""), sessions]
    if stats.get("last_turn"):
        parts += [Text(""), Text("last turn: ", style="bold") + stats_line(stats["last_turn"])]
    return Group(*parts)


def remote_view(stats: dict) -> Group:
    """/stats with --server: no local pool; the server, its endpoint, how exact the history is, its cache."""
    remote = stats["remote"]
    table = Table(title="remote server", show_header=False, title_justify="left", box=None, padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    table.add_row("server", f"{remote['server']} (model {remote['model']})")
    table.add_row("endpoint", remote["endpoint"])
    history = ("token-exact: the tree holds the ids the server saw and produced" if remote["history"] == "token-exact"
               else "text-exact: replies are stored as text (re-encoded locally where a tokenizer is known)")
    table.add_row("history", history)
    table.add_row("prefix cache", f"{remote['cached_tokens_total']} of {remote['prompt_tokens_total']} prompt tokens "
                                  f"served from the server's cache (as its usage reports)")
    parts = [table]
    if stats.get("last_turn"):
        parts += [Text(""), Text("last turn: ", style="bold") + stats_line(stats["last_turn"])]
    return Group(*parts)


def local_time(iso: str) -> str:
    try:
        return datetime.fromisoformat(iso).astimezone().strftime("%Y-%m-%d %H:%M")
    except ValueError:
        return iso[:16]


def sessions_view(infos, resident: dict, current: str | None) -> Table:
    table = Table(box=None, padding=(0, 1), header_style="bold")
    table.add_column("")
    table.add_column("name", no_wrap=True)
    table.add_column("model", overflow="fold", min_width=12)
    table.add_column("messages", justify="right", no_wrap=True)
    table.add_column("branches", justify="right", no_wrap=True)
    table.add_column("updated", no_wrap=True)
    seen = set()
    for info in infos:
        seen.add(info.name)
        mark = "*" if info.name == current else ("●" if info.name in resident else "")
        table.add_row(mark, Text(info.name), Text(info.model), str(info.messages), str(info.branches),
                      local_time(info.updated))
    for name, s in resident.items():
        if name not in seen:
            table.add_row("*" if name == current else "●", Text(name), Text(s.model), str(s.num_messages),
                          str(len(s.tree.leaves())), "(not saved yet)")
    return table


def settings_view(params, sources: dict, chat: dict | None = None) -> Table:
    """Sampling settings and, from `chat`, the chat's own ({key: (value, source)})."""
    table = Table(box=None, padding=(0, 2), header_style="bold")
    for column in ("setting", "value", "from"):
        table.add_column(column)
    for key in ("temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "repetition_penalty", "stop"):
        table.add_row(key, repr(getattr(params, key)), sources.get(key, "built-in default"))
    for key, (value, source) in (chat or {}).items():
        table.add_row(key, str(value), source)
    return table


def export_markdown(session: Session, all_branches: bool = False) -> str:
    """The current conversation (or every branch) as Markdown."""
    lines = [f"# {session.name}", "", f"- model: {session.model}", f"- created: {local_time(session.created)}",
             f"- updated: {local_time(session.updated)}", ""]
    branches = [session.path()] if not all_branches else [session.tree.path(leaf.id)
                                                          for leaf in session.tree.leaves()]
    for number, path in enumerate(branches, 1):
        if all_branches:
            lines += [f"## branch {number} (ends at #{path[-1].id})", ""]
        for node in path:
            title = {"system": "System", "user": "User", "assistant": "Assistant"}[node.role]
            extra = (f" (variant {node.variant})" if node.variant else "") + (" [interrupted]" if node.interrupted else
                                                                           " [length]" if node.finish_reason == "length" else "")
            lines += [f"**{title}**{extra} <!-- #{node.id} -->", "", node.text, ""]
    return "\n".join(lines).rstrip() + "\n"
