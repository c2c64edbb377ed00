"""The chat tool: conversation trees with token-exact history on the engine's shared paged KV pool.

    tree.py        nodes (role, text, exact token ids) linked into a tree; nothing is ever overwritten
    turns.py       the token ids of the next turn: stored history + the template-rendered new message
    session.py     a session: tree, head, model, settings; its JSON form
    store.py       sessions on disk (XDG data dir, atomic 0600 writes, corrupt files set aside)
    controller.py  the resident sessions and their turns (/regen, /edit, /fork, /switch ...), no terminal
    options.py     settings and their sources: /set, /think, /logprobs, schema, context overflow
    context.py     a turn's prompt ids fitted into the context window (drop-oldest), or its chat messages
    stats.py       a turn's stats line and the /stats pool report, as plain dicts
    backend.py     the engine as the controller uses it (remote_backend.py: the same over --server)
    shell.py       slash commands and live streaming on a rich Console (ChatShell, ChatUI)
    repl.py        the prompt-toolkit REPL around ChatShell
    render.py      rich renderables: replies, variants side by side, stats line, tree, tables
    app.py         command-line start-up shared by `chat` and `run --session`
    oneshot.py     `run --session NAME` / `run -c`
"""
