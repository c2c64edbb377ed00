"""Conversation trees on the engine: token-exact turns, nothing lost on regen/edit/fork, cached branches."""

import pytest

from chat_support import make_controller, make_engine
from pagedchat.chat.tree import Node, Tree
from pagedchat.chat.turns import Templater
from pagedchat.errors import UserError


@pytest.fixture
def ctl(model, tmp_path):
    c = make_controller(make_engine(model), model, tmp_path / "sessions", system="be brief")
    c.new_session("t")
    return c


def _full_render(tok, messages):
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("system", [None, "be brief"])
def test_turn_suffixes_reproduce_the_full_chatml_render(ctl, system):
    """With replies tokenized canonically, stored ids + each new suffix == rendering the whole conversation."""
    tok = ctl.engine.tokenizer
    t = Templater(tok, end_token_ids=ctl.engine.eos_token_ids)
    tree, messages, head = Tree(), [], None
    if system:
        head = tree.add(None, "system", system, t.system_tokens(system)).id
        messages.append({"role": "system", "content": system})
    for user, reply in [("hello world", "the quick brown fox"), ("what is 17 + 25?", "it is 42."),
                        ("a b c", "d e f")]:
        node = tree.add(head, "user", user, t.user_turn_tokens(tree.path(head), user))
        messages.append({"role": "user", "content": user})
        assert tree.path_tokens(node.id) == _full_render(tok, messages)
        eos = tok.convert_tokens_to_ids("<|im_end|>")
        head = tree.add(node.id, "assistant", reply, t.encode(reply) + [eos]).id
        messages.append({"role": "assistant", "content": reply})


def test_a_template_that_rewrites_old_turns_keeps_the_ids_the_model_saw(ctl):
    """Like Qwen3 dropping old reasoning: the stored ids stay, only the end-of-turn glue and the new turn
    are appended (re-rendering would change the prefix and throw the cache away)."""
    import copy

    tok = copy.deepcopy(ctl.engine.tokenizer)
    tok.chat_template = (
        "{% for m in messages %}{% set c = m['content'] %}"
        "{% if m['role'] == 'assistant' and not loop.last %}{% set c = c.split('</think>')[-1] %}{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ c }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    t = Templater(tok, end_token_ids=ctl.engine.eos_token_ids)
    tree = Tree()
    user = tree.add(None, "user", "hi", t.user_turn_tokens([], "hi"))
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    reply = tree.add(user.id, "assistant", "answer", t.encode("<think>abc</think>answer") + [eos])
    suffix = t.decode(t.user_turn_tokens(tree.path(reply.id), "next"))
    assert suffix == "\n<|im_start|>user\nnext<|im_end|>\n<|im_start|>assistant\n"


def test_history_ids_are_never_retokenized(ctl):
    """The model's own ids for a reply stay in the prompt even where BPE would split the text differently."""
    first = ctl.send("hello world")
    second = ctl.send("what is 17 + 25?")
    tree = ctl.session.tree
    history = tree.path_tokens(first.replies[0].id)
    prompt = tree.path_tokens(second.user.id)
    assert prompt[:len(history)] == history
    ended = first.replies[0].token_ids[-1] in ctl.engine.eos_token_ids
    close = "\n" if ended else "<|im_end|>\n"  # a reply cut by max_tokens is closed by the next suffix
    assert ctl.templater.decode(second.user.token_ids) == \
        close + "<|im_start|>user\nwhat is 17 + 25?<|im_end|>\n<|im_start|>assistant\n"


def test_interrupted_reply_is_closed_by_the_next_suffix(ctl):
    t = Templater(ctl.engine.tokenizer, end_token_ids=ctl.engine.eos_token_ids)
    tree = Tree()
    user = tree.add(None, "user", "hi", t.user_turn_tokens([], "hi"))
    partial = tree.add(user.id, "assistant", "", [])  # Ctrl-C before the first token
    suffix = t.decode(t.user_turn_tokens(tree.path(partial.id), "again"))
    assert suffix == "<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    half = tree.add(user.id, "assistant", "the qu", t.encode("the qu"))
    suffix = t.decode(t.user_turn_tokens(tree.path(half.id), "again"))
    assert suffix.startswith("<|im_end|>\n<|im_start|>user\nagain")


def test_second_turn_prefills_only_the_new_message(ctl):
    first = ctl.send("hello world")
    second = ctl.send("what is 17 + 25?")
    history = first.stats["prompt_tokens"] + len(first.replies[0].token_ids)
    assert first.stats["prompt_cached"] == 0
    # Everything the first turn computed is served from the pinned branch (its last sampled token was
    # never fed through the model, so it is recomputed with the new message).
    assert second.stats["prompt_cached"] == history - 1
    assert second.stats["prompt_new"] == second.stats["prompt_tokens"] - (history - 1)


def test_regen_edit_fork_never_lose_a_node(ctl):
    ctl.send("hello world")
    ctl.send("what is 17 + 25?")
    seen = {n.id: (n.role, n.text, list(n.token_ids)) for n in ctl.session.tree.nodes.values()}
    user2 = ctl.session.head_node().parent

    regen = ctl.regen()
    assert regen.replies[0].parent == user2 and len(ctl.session.tree.children(user2)) == 2
    assert "/regen would repeat the same reply" in regen.notes[0]  # so it samples instead
    fork = ctl.fork(3)
    assert [r.variant for r in fork.replies] == [1, 2, 3]
    assert all(r.parent == user2 for r in fork.replies)
    assert fork.notes and "temperature" in fork.notes[0]  # greedy would give 3 identical variants
    first_user = ctl.session.path()[1].id
    edit = ctl.edit(first_user, "hello there")
    assert edit.user.parent == ctl.session.tree.get(first_user).parent and edit.user.id != first_user

    for node_id, (role, text, ids) in seen.items():  # every earlier node is still there, unchanged
        node = ctl.session.tree.get(node_id)
        assert (node.role, node.text, node.token_ids) == (role, text, ids)
    assert len(ctl.session.tree) == len(seen) + 1 + 3 + 2
    assert ctl.pick(2).id == fork.replies[1].id
    ctl.engine.check_invariants()


def test_switching_back_reuses_the_old_branch_via_its_pin_and_via_the_prefix_cache(ctl):
    ctl.send("hello world")
    old = ctl.send("what is 17 + 25?").replies[0]
    ctl.edit(ctl.session.path()[1].id, "a b c d e f g h i j k l m n o p")  # move to another branch
    ctl.switch(old.id)
    pinned = ctl.send("and then?")
    old_history = len(ctl.session.tree.path_tokens(old.id))
    assert pinned.stats["prompt_cached"] == old_history - 1  # the old branch head's pin

    for handle in list(ctl.session.handles.values()):  # drop every pin: only the prefix cache is left
        ctl.engine.release(handle)
    ctl.session.handles.clear()
    ctl.switch(old.id)
    cached = ctl.send("and then?")
    assert cached.stats["prompt_cached"] >= (old_history // 16) * 16 - 16 > 0
    ctl.engine.check_invariants()


def test_fork_prefills_once_and_streams_every_variant(ctl):
    ctl.send("hello world")
    seen = {}
    result = ctl.fork(3, "tell me more", on_update=lambda i, text: seen.__setitem__(i, text))
    assert sorted(seen) == [0, 1, 2]
    assert result.user is not None and len(result.replies) == 3
    assert len({tuple(r.token_ids) for r in result.replies}) > 1  # sampled, not greedy copies
    assert result.stats["prompt_new"] < result.stats["prompt_tokens"]
    assert ctl.session.last_fork == [r.id for r in result.replies]
    assert ctl.session.head == result.replies[0].id


def test_system_prompt_is_a_shared_root(ctl):
    a = ctl.send("hello world")
    ctl.clear()
    b = ctl.send("what is 17?")
    roots = ctl.session.tree.children(None)
    assert len(roots) == 1 and roots[0].role == "system" and roots[0].text == "be brief"
    assert ctl.session.tree.get(a.user.id).parent == ctl.session.tree.get(b.user.id).parent == roots[0].id
    assert b.stats["prompt_cached"] > 0  # the system prompt's blocks are shared
    note = ctl.set_system("be verbose")
    assert "new branch" in note and ctl.session.head is None
    c = ctl.send("hi")
    assert ctl.session.path(c.user.id)[0].text == "be verbose"


def test_user_errors_are_clear(ctl):
    with pytest.raises(UserError, match="nothing to regenerate"):
        ctl.regen()
    with pytest.raises(UserError, match="nothing to fork yet"):
        ctl.fork(2)
    r = ctl.send("hello world")
    with pytest.raises(UserError, match="no node #99"):
        ctl.switch(99)
    with pytest.raises(UserError, match="user messages"):
        ctl.edit(r.replies[0].id, "x")
    with pytest.raises(UserError, match="no variants"):
        ctl.pick(1)
    ctl.switch(r.user.id)
    with pytest.raises(UserError, match="no reply yet"):
        ctl.send("another")
    with pytest.raises(UserError, match="from 1 to"):
        ctl.fork(0)
    with pytest.raises(UserError, match="unknown setting 'foo'; keys: temperature"):
        ctl.set_option("foo", "1")
    with pytest.raises(UserError, match="top_p must be in"):
        ctl.set_option("top_p", "2")
    with pytest.raises(UserError, match="must be an integer"):
        ctl.set_option("top_k", "many")


def test_set_layers_between_cli_and_session(ctl):
    assert "command line wins" in ctl.set_option("temperature", "0.5")  # the CLI gave --temperature 0
    params, sources = ctl.sampling()
    assert params.temperature == 0 and sources["temperature"] == "command-line flag"
    ctl.set_option("top_k", "7")
    ctl.set_option("stop", '["\\n\\n", "User:"]')
    params, sources = ctl.sampling()
    assert params.top_k == 7 and sources["top_k"] == "/set" and params.stop == ["\n\n", "User:"]
    ctl.set_option("top_k", "default")
    assert ctl.sampling()[0].top_k == 0


def test_small_context_caps_replies_and_then_says_it_is_full(model, tmp_path):
    c = make_controller(make_engine(model, max_model_len=96), model, tmp_path / "s", max_tokens=4000)
    c.new_session("small")
    r = c.send("hello world")
    assert r.stats["capped_max_tokens"] == (96 - r.stats["prompt_tokens"]) // 2
    assert len(r.replies[0].token_ids) <= r.stats["capped_max_tokens"]
    with pytest.raises(UserError, match="context is full|model's context"):
        for _ in range(6):
            c.send("what is 17 + 25?")


def test_tree_rejects_broken_node_lists():
    good = Tree()
    good.add(None, "user", "a", [1, 2])
    assert Tree.from_list(good.to_list()).get(1).token_ids == [1, 2]
    for bad in ([{"id": 2, "parent": 1, "role": "user", "text": "", "token_ids": []}],
                [{"id": 1, "parent": None, "role": "robot", "text": "", "token_ids": []}],
                [{"id": 1, "parent": None, "role": "user", "text": "", "token_ids": ["x"]}],
                [{"id": 1, "parent": None, "role": "user"}]):
        with pytest.raises(ValueError):
            Tree.from_list(bad)
    assert isinstance(Node(1, None, "user", "", []).created, str)
