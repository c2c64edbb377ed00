"""/logprobs and /branch: a reply's token alternatives, and a sibling reply started from one of them.

The numbers shown must be the engine's own (checked against transformers' log-softmax), the branch must
be exactly "first I tokens + ALT + the greedy continuation of that prompt" (checked against transformers'
generate on the same ids), and both survive a save and reload.
"""

import math

import pytest
import torch

from chat_support import make_controller, make_engine, text_console


@pytest.fixture
def ctl(model, tmp_path):
    c = make_controller(make_engine(model), model, tmp_path / "sessions", max_tokens=12)
    c.new_session("main")
    return c


@pytest.fixture
def shell(ctl):
    from pagedchat.chat.shell import ChatShell, ChatUI

    console, screen = text_console()
    sh = ChatShell(ctl, ChatUI(console))
    sh.screen = screen
    return sh


def _hf(model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()


def test_logprobs_on_stores_the_engines_numbers_per_reply_token(ctl, model):
    ctl.set_logprobs("on")
    reply = ctl.send("hello there").replies[0]
    assert reply.logprobs is not None and len(reply.logprobs) == len(reply.token_ids)
    prompt = ctl.session.tree.path_tokens(reply.parent)
    ids = torch.tensor([prompt + reply.token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(_hf(model)(ids).logits[0, len(prompt) - 1:-1].float(), dim=-1)
    for i, (token, (logprob, top)) in enumerate(zip(reply.token_ids, reply.logprobs)):
        assert logprob == pytest.approx(ref[i, token].item(), abs=1e-3)
        assert [t for t, _ in top] == ref[i].topk(len(top)).indices.tolist()   # greedy: the chosen is top 1
        assert top[0][0] == token


def test_logprobs_off_keeps_nothing(ctl):
    assert ctl.send("hello").replies[0].logprobs is None
    ctl.set_logprobs("on")
    ctl.set_logprobs("off")
    assert ctl.send("again").replies[0].logprobs is None


def test_branch_keeps_the_prefix_takes_the_alternative_and_continues_greedily(ctl, model):
    ctl.set_logprobs("on")
    first = ctl.send("tell me a story").replies[0]
    index = min(3, len(first.token_ids) - 2)
    alt = first.logprobs[index][1][1][0]                 # the second most likely token there
    result = ctl.branch(index, "1")
    second = result.replies[0]
    assert second.parent == first.parent and second.id != first.id        # a sibling reply
    assert second.token_ids[:index] == first.token_ids[:index]
    assert second.token_ids[index] == alt
    assert ctl.session.head == second.id
    # the continuation is exactly transformers' greedy continuation of prompt + prefix + alt
    prompt = ctl.session.tree.path_tokens(first.parent) + first.token_ids[:index] + [alt]
    want = _hf(model).generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12 - index - 1,
                               eos_token_id=sorted(ctl.templater.end_ids), pad_token_id=0)[0, len(prompt):].tolist()
    got = second.token_ids[index + 1:]
    assert got == want[:len(got)] and len(got) >= 1
    # only the new token was prefilled: the rest of the prompt came from the first reply's pinned KV
    assert result.stats["prompt_new"] == 1, result.stats
    # its logprobs: the shared prefix's rows, the alternative's own value, then its own tokens
    assert second.logprobs[:index] == first.logprobs[:index]
    assert second.logprobs[index][0] == first.logprobs[index][1][1][1]
    assert len(second.logprobs) == len(second.token_ids)


def test_branch_by_text_and_errors(ctl):
    from pagedchat.errors import UserError

    with pytest.raises(UserError, match="starts from a reply"):
        ctl.branch(0, "1")
    first = ctl.send("hello").replies[0]          # logprobs off: no stored alternatives
    with pytest.raises(UserError, match="outside reply"):
        ctl.branch(len(first.token_ids), "x")
    word = ctl.templater.decode([first.token_ids[0]])
    with pytest.raises(UserError, match="already is"):
        ctl.branch(0, word)
    with pytest.raises(UserError, match="not one"):
        ctl.branch(0, "a long phrase of several tokens")
    other = next(t for t in range(100, 200) if t != first.token_ids[0] and t not in ctl.templater.end_ids
                 and ctl.templater.encode(ctl.templater.decode([t])) == [t])
    reply = ctl.branch(0, ctl.templater.decode([other])).replies[0]
    assert reply.token_ids[0] == other and reply.logprobs is None


def test_branch_to_an_end_token_ends_the_reply_there(ctl):
    first = ctl.send("hello").replies[0]
    end = sorted(ctl.templater.end_ids)[0]
    if first.token_ids[1] == end:
        pytest.skip("the reply already ends at token 1")
    reply = ctl.branch(1, ctl.templater.decode([end])).replies[0]
    assert reply.token_ids == [first.token_ids[0], end] and reply.finish_reason == "stop"


def test_alternatives_survive_a_save_and_reload(ctl, model, tmp_path):
    ctl.set_logprobs("on")
    reply = ctl.send("hello").replies[0]
    ctl.save()
    again = make_controller(make_engine(model), model, tmp_path / "sessions", max_tokens=12)
    session, _ = again.open_session("main")
    assert session.node(reply.id).logprobs == reply.logprobs
    assert again.logprobs_on()
    assert again.branch(0, "2").replies[0].token_ids[0] == reply.logprobs[0][1][2][0]


def test_a_session_file_with_bad_logprobs_is_refused_with_a_clear_message():
    from pagedchat.chat.tree import Node

    good = {"id": 1, "parent": None, "role": "assistant", "text": "a", "token_ids": [5],
            "logprobs": [[-0.1, [[5, -0.1], [6, -2.5]]]]}
    assert Node.from_dict(good).logprobs == good["logprobs"]
    for bad in ([[-0.1]], [[-0.1, [[5]]]], [], [["x", []]]):
        with pytest.raises(ValueError, match="logprobs"):
            Node.from_dict({**good, "logprobs": bad})


def test_the_repl_shows_where_the_model_hesitated_and_branches(shell, ctl):
    shell.handle("/logprobs on")
    shell.handle("tell me a story")
    screen = shell.screen.getvalue()
    assert "logprobs on" in screen
    reply = ctl.session.head_node()
    hesitant = [i for i, row in enumerate(reply.logprobs) if math.exp(row[0]) < 0.9]
    if hesitant:
        assert "where the model hesitated" in screen
        line = next(ln for ln in screen.splitlines() if ln.strip().startswith(f"{hesitant[0]} "))
        assert " · 1 " in line and "%" in line
    shell.handle("/logprobs")
    listing = shell.screen.getvalue()[len(screen):]
    assert len([ln for ln in listing.splitlines() if " · 1 " in ln]) == len(reply.token_ids)
    before = shell.screen.getvalue()
    shell.handle("/branch 1 2")
    after = shell.screen.getvalue()[len(before):]
    assert "prompt" in after and "cached" in after       # a turn: the stats line
    new = ctl.session.head_node()
    assert new.parent == reply.parent and new.token_ids[1] == reply.logprobs[1][1][2][0]
    shell.handle("/branch x")
    assert "usage: /branch TOKEN_INDEX ALTERNATIVE" in shell.screen.getvalue()
