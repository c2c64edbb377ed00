"""The demo model's byte-level BPE tokenizer (digits split one per token) and the tokenization of
conversations into (ids, loss mask) exactly as the chat template renders them."""

from __future__ import annotations

import random

from pagedchat.demo.corpus import (ADD_Q, CAPITALS, CAP_F, CAP_Q, COUNT_F, COUNT_Q, Conversation, DONT_KNOW,
    EVAL_COUNT_Q, EVAL_REV_Q, IM_END, IM_START, MINUS_F, MUL_Q, OUT_OF_SCOPE, PAD, PLUS_F, REV_F, REV_MARK,
    REV_Q, SMALL_TALK, SPELL_Q, SUB_Q, SYSTEM_PROMPTS, TIMES_F, WORD_F, capital_answer, first_upper)

# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------


def tokenizer_corpus() -> list[str]:
    """Text for BPE merges: the phrasings and fixed answers, NOT the spelling word list.

    Learning merges only from template text keeps the spelling words split into short, shared
    pieces, so the model can learn each piece's letters and still spell held-out words.
    """
    lines = []
    rng = random.Random(0)
    for table in (ADD_Q, SUB_Q, MUL_Q, PLUS_F, MINUS_F, TIMES_F, REV_Q, SPELL_Q, COUNT_Q, REV_F,
                  COUNT_F, WORD_F, EVAL_REV_Q, EVAL_COUNT_Q):
        for t in table:
            for _ in range(20):
                lines.append(t.format(a=rng.randint(0, 99), b=rng.randint(0, 99), n=rng.randint(0, 99),
                                      w="", c="", C=""))
    for country, capital in CAPITALS:
        for t in CAP_Q + CAP_F:
            lines.append(t.format(c=country, C=first_upper(country)))
        lines.append(capital_answer(country, capital))
    for qs, answer in SMALL_TALK:
        lines += qs * 5 + [answer] * 20
    lines += OUT_OF_SCOPE * 3 + [DONT_KNOW] * 20 + SYSTEM_PROMPTS * 10
    lines += ["The letters are 1, 2, 3, 4, 5. So the word has 5 letters. Backwards they are. "
              "So the word backwards is. So it is spelled."] * 50
    lines += [f"user\nassistant\nsystem\n{i}" for i in range(10)] * 20
    # Every " x" letter token must exist: the letter lists are made of them.
    lines += [", ".join(f"{i} {ch}" for i, ch in enumerate("abcdefghijklmnopqrstuvwxyz"))] * 100
    return lines


def train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # Digits first: every digit becomes its own token, so numbers are sequences of digits.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        # Pieces of at most 4 letters after a space (5 inside a word): each piece's spelling is a
        # short fact to learn, and no long template word ('language') becomes one opaque token.
        max_token_length=5)
    tok.train_from_iterator(tokenizer_corpus(), trainer)
    return tok


class Tokenized:
    """Turns conversations into (ids, loss mask) exactly as the chat template would render them."""

    def __init__(self, tok):
        self.tok = tok
        self.im_start = tok.token_to_id(IM_START)
        self.im_end = tok.token_to_id(IM_END)
        self.nl = self.enc("\n")
        self.cache: dict[str, list[int]] = {}

    def enc(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def header(self, role: str) -> list[int]:
        if role not in self.cache:
            self.cache[role] = [self.im_start] + self.enc(role + "\n")
        return self.cache[role]

    def encode_answer(self, text: str) -> list[int]:
        """Canonical BPE, except the span between REV_MARKs: one token per character.

        Writing a reversed word as single letters is what the model can do reliably: it just
        copies the letters it listed. The decoded text is identical to the canonical one.
        """
        if REV_MARK not in text:
            return self.enc(text)
        before, word, after = text.split(REV_MARK)
        chars = [self.enc(" " + word[0])] if before.endswith(" ") else [self.enc(word[0])]
        if before.endswith(" "):
            before = before[:-1]
        ids = self.enc(before)
        if len(chars[0]) != 1:  # no single " x" token: space and letter separately
            chars[0] = self.enc(" ") + self.enc(word[0])
        for ch in word[1:]:
            chars.append(self.enc(ch))
        for c in chars:
            ids += c
        return ids + self.enc(after)

    def conversation(self, conv: Conversation) -> tuple[list[int], list[int]]:
        ids, mask = [], []

        def add(part, learn):
            ids.extend(part)
            mask.extend([int(learn)] * len(part))

        if conv.system is not None:
            add(self.header("system") + self.enc(conv.system) + [self.im_end] + self.nl, False)
        for t in conv.turns:
            add(self.header("user") + self.enc(t.user) + [self.im_end] + self.nl + self.header("assistant"), False)
            # The answer and its <|im_end|> are the targets; the "\n" after it belongs to the template.
            add(self.encode_answer(t.answer) + [self.im_end], True)
            add(self.nl, False)
        return ids, mask
