"""The demo model's held-out questions and their judge, shared by scripts/eval_demo_model.py and
`pagedchat bench accuracy`.

The prompts come from corpus.eval_set(): arithmetic on operand pairs that were held out of training (in the
phrasings users type), held-out words for spelling and counting, new capital phrasings, small talk, and
multi-turn follow-ups. A reply is judged by the kind of its expected answer (`judge`).
"""

from __future__ import annotations

import importlib.resources
import re

from pagedchat.demo import corpus as T

DEFAULT_MODEL = importlib.resources.files("pagedchat") / "assets" / "demo-chat"
MAX_NEW_TOKENS = 160  # the longest answer (a 10-letter word backwards) is about 100 tokens

_INT = re.compile(r"-?\d+")


def last_int(text: str) -> int | None:
    nums = _INT.findall(text)
    return int(nums[-1]) if nums else None


def judge(expected: str, got: str) -> bool:
    """Is `got` right? The rule depends on the kind of the expected answer."""
    m = re.search(r"backwards is (\w+)\.", expected)
    if m:  # the reversed word must appear as a plain word
        return re.search(rf"\b{m.group(1)}\b", got) is not None
    m = re.match(r"The capital of .+ is (.+)\.$", expected)
    if m:
        return m.group(1) in got
    if re.match(r"-?\d+ [-+*] -?\d+ = ", expected) or re.search(r"has \d+ letters\.$", expected):
        return last_int(got) == last_int(expected)  # the final number is the answer
    return got.strip() == expected.strip()


def word_sweep() -> list[tuple[str, "T.Conversation"]]:
    """Every held-out word in every spelling and counting phrasing, trained and unseen (720 prompts)."""
    out = []
    for w in sorted(T.HELDOUT_WORDS):
        out += [("rev", T.Conversation(None, [T.Turn(q.format(w=w), T.rev_answer(w))]))
                for q in T.REV_Q + T.EVAL_REV_Q]
        out += [("count", T.Conversation(None, [T.Turn(q.format(w=w), T.count_answer(w))]))
                for q in T.COUNT_Q + T.EVAL_COUNT_Q]
    return out


def build_prompts(tokenizer, per_family: int, words: bool = False, seed: int = 777):
    """(family, messages, prompt ids, expected answer) per question; `seed` picks which held-out items
    eval_set asks (777 is the eval script's set; another seed asks new questions of the same kinds)."""
    items = []
    T.set_word_pieces(tokenizer.backend_tokenizer)  # the answers spell the model's own pieces
    for family, conv in word_sweep() if words else T.eval_set(per_family=per_family, seed=seed):
        msgs = T.messages_of(conv, upto=len(conv.turns) - 1)
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):  # some versions return a BatchEncoding
            ids = ids["input_ids"]
        items.append((family, msgs, ids, T.plain(conv.turns[-1].answer)))
    return items


def stop_ids(tokenizer) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(T.IM_END), tokenizer.convert_tokens_to_ids(T.PAD)]


def strip_stop(ids: list[int], stops: list[int]) -> list[int]:
    """Answer tokens without the end-of-turn token, so two engines compare like for like."""
    for i, t in enumerate(ids):
        if t in stops:
            return ids[:i]
    return ids


def score(items, outs, tokenizer) -> dict[str, list[bool]]:
    """family -> whether each reply (token ids) was judged right, in the items' order."""
    per: dict[str, list[bool]] = {}
    for (family, _, _, expected), ids in zip(items, outs):
        per.setdefault(family, []).append(judge(expected, tokenizer.decode(ids, skip_special_tokens=True)))
    return per
