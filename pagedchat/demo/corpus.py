"""The demo model's data: fact tables and word lists (with the held-out split), the phrasings and
answer formats, the multi-turn conversation generator, and the held-out evaluation set that
pagedchat/demo/evaluate.py asks (scripts/train_demo_model.py trains on the rest)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

# ----------------------------------------------------------------------------------------------
# Fact tables and word lists
# ----------------------------------------------------------------------------------------------

# (country as written in prose, capital). A leading "the " is optional when users ask.
CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Portugal", "Lisbon"), ("the United Kingdom", "London"), ("Ireland", "Dublin"),
    ("the Netherlands", "Amsterdam"), ("Belgium", "Brussels"), ("Switzerland", "Bern"),
    ("Austria", "Vienna"), ("Poland", "Warsaw"), ("the Czech Republic", "Prague"),
    ("Hungary", "Budapest"), ("Greece", "Athens"), ("Sweden", "Stockholm"), ("Norway", "Oslo"),
    ("Denmark", "Copenhagen"), ("Finland", "Helsinki"), ("Iceland", "Reykjavik"),
    ("Russia", "Moscow"), ("Ukraine", "Kyiv"), ("Turkey", "Ankara"), ("Egypt", "Cairo"),
    ("Kenya", "Nairobi"), ("Nigeria", "Abuja"), ("Morocco", "Rabat"), ("Ethiopia", "Addis Ababa"),
    ("Ghana", "Accra"), ("China", "Beijing"), ("Japan", "Tokyo"), ("South Korea", "Seoul"),
    ("India", "New Delhi"), ("Pakistan", "Islamabad"), ("Thailand", "Bangkok"),
    ("Vietnam", "Hanoi"), ("Indonesia", "Jakarta"), ("the Philippines", "Manila"),
    ("Australia", "Canberra"), ("New Zealand", "Wellington"), ("Canada", "Ottawa"),
    ("the United States", "Washington, D.C."), ("Mexico", "Mexico City"), ("Brazil", "Brasilia"),
    ("Argentina", "Buenos Aires"), ("Chile", "Santiago"), ("Peru", "Lima"), ("Colombia", "Bogota"),
    ("Cuba", "Havana"), ("Iran", "Tehran"),
]

# Places the model should NOT pretend to know.
UNKNOWN_PLACES = [
    "Atlantis", "Narnia", "Wakanda", "Mordor", "Gondor", "Oz", "Utopia", "Lilliput", "Freedonia",
    "Elbonia", "Genovia", "Latveria", "Zubrowka", "Florin", "Ruritania", "the Moon", "Mars",
]

WORDS = """
apple table garden planet orange window bottle yellow purple silver summer winter spring autumn
river forest mountain ocean island desert valley meadow flower garden candle pencil paper letter
number music guitar piano violin dance story poem book page chapter school teacher student class
lesson friend family mother father sister brother child baby person people woman man king queen
castle tower bridge road street city town village house home room door floor wall roof kitchen
chair sofa lamp clock mirror picture camera phone computer screen mouse keyboard cable button
water coffee tea milk juice bread butter cheese cookie cake honey sugar salt pepper lemon banana
cherry grape melon peach tomato potato carrot onion garlic rice pasta pizza soup salad dinner
lunch breakfast morning evening night today tomorrow week month year season holiday travel
journey ticket train plane boat ship car truck bicycle engine wheel horse tiger lion zebra monkey
rabbit turtle dragon eagle parrot spider insect fish shark whale dolphin snake frog duck goose
chicken cow sheep goat pig dog cat kitten puppy animal nature cloud rain storm thunder snow ice
fire stone rock sand metal gold iron wood glass plastic cotton wool silk paint color green blue
black white brown pink happy sad angry calm brave clever gentle quick slow strong simple strange
quiet loud bright dark warm cold soft hard heavy light small large little big tiny giant short
long early late young old new modern ancient famous secret magic wonder dream idea question answer
problem reason method system energy power signal market money price value office worker doctor
nurse farmer pilot artist writer singer player winner hunter driver captain soldier police
kingdom empire nation country border center circle square triangle corner line point shape size
weight height length speed sound voice word name language science history nature planet rocket
galaxy comet star moon earth sun sky wind weather field farm plant seed tree leaf root branch
jacket shirt dress shoes hat glove pocket basket blanket pillow carpet button ribbon
""".split()
WORDS = list(dict.fromkeys(WORDS))  # drop repeats, keep the order

# Fixed held-out sets: chosen with a constant seed so every --seed holds out the same items.
HOLDOUT_SEED = 12345
N_HELDOUT_PAIRS = 300
N_HELDOUT_WORDS = 40


def heldout_sets():
    """Operand pairs and words never used as a fresh question in training."""
    rng = random.Random(HOLDOUT_SEED)
    all_pairs = [(a, b) for a in range(100) for b in range(100)]
    pairs = set(rng.sample(all_pairs, N_HELDOUT_PAIRS))
    words = set(rng.sample(sorted(WORDS), N_HELDOUT_WORDS))
    return pairs, words


HELDOUT_PAIRS, HELDOUT_WORDS = heldout_sets()
TRAIN_WORDS = [w for w in WORDS if w not in HELDOUT_WORDS]

# ----------------------------------------------------------------------------------------------
# Phrasings. Training uses every template; eval_demo_model.py also tries the EVAL_ ones.
# ----------------------------------------------------------------------------------------------

ADD_Q = ["What is {a} + {b}?", "What is {a} plus {b}?", "Calculate {a} + {b}.", "What's {a} + {b}?",
         "Compute {a} + {b}.", "{a} + {b} = ?", "Add {a} and {b}.", "What is the sum of {a} and {b}?",
         "How much is {a} + {b}?", "{a} + {b}", "Calculate {a} plus {b}.", "What is {a}+{b}?"]
SUB_Q = ["What is {a} - {b}?", "What is {a} minus {b}?", "Calculate {a} - {b}.", "What's {a} - {b}?",
         "Compute {a} - {b}.", "{a} - {b} = ?", "Subtract {b} from {a}.", "How much is {a} - {b}?",
         "{a} - {b}", "Calculate {a} minus {b}.", "What is {a}-{b}?"]
MUL_Q = ["What is {a} times {b}?", "What is {a} * {b}?", "Calculate {a} * {b}.", "What's {a} times {b}?",
         "Compute {a} * {b}.", "{a} * {b} = ?", "Multiply {a} by {b}.", "What is {a} multiplied by {b}?",
         "What is {a} x {b}?", "How much is {a} times {b}?", "What is the product of {a} and {b}?",
         "Calculate {a} times {b}.", "{a} * {b}", "What is {a}*{b}?"]
# Follow-ups on the previous numeric answer ("that").
PLUS_F = ["And what is that plus {n}?", "What is that plus {n}?", "Now add {n}.", "Add {n} to that.",
          "And plus {n}?", "What if you add {n}?"]
MINUS_F = ["And what is that minus {n}?", "What is that minus {n}?", "Now subtract {n}.",
           "Subtract {n} from that.", "And minus {n}?"]
TIMES_F = ["And what is that times {n}?", "What is that times {n}?", "Now multiply it by {n}.",
           "Multiply that by {n}."]

CAP_Q = ["What is the capital of {c}?", "What's the capital of {c}?", "Which city is the capital of {c}?",
         "Name the capital of {c}.", "{C}'s capital is which city?", "What is the capital city of {c}?",
         "Capital of {c}?", "What city is the capital of {c}?", "Tell me the capital of {c}.",
         "What is {c}'s capital?", "{C}'s capital?", "Do you know what the capital of {c} is?",
         "I want to know the capital of {c}.", "Which city is the capital city of {c}?"]
EVAL_CAP_Q = ["Do you know the capital of {c}?", "Which city is {c}'s capital?"]
CAP_F = ["What about {c}?", "And {c}?", "And what about {c}?", "How about {c}?", "And the capital of {c}?"]

REV_Q = ["Spell the word {w} backwards.", "Reverse the word {w}.", "Spell {w} backwards.",
         "What is {w} spelled backwards?", "Write {w} backwards.", "How do you spell {w} backwards?",
         "Can you reverse the word {w}?", "Reverse {w}.", "Write the word {w} in reverse."]
EVAL_REV_Q = ["Please spell {w} backwards."]
SPELL_Q = ["Spell the word {w}.", "How do you spell {w}?", "Spell {w}."]
COUNT_Q = ["How many letters are in the word {w}?", "How many letters does {w} have?",
           "Count the letters in {w}.", "How long is the word {w}?", "How many letters are in {w}?",
           "What is the number of letters in the word {w}?", "How many letters does the word {w} have?"]
EVAL_COUNT_Q = ["Count the letters of the word {w}."]
REV_F = ["Spell it backwards.", "Now spell it backwards.", "And backwards?", "Reverse it.",
         "Can you reverse it?"]
COUNT_F = ["How many letters does it have?", "How many letters is that?", "And how many letters?",
           "Count its letters."]
WORD_F = ["What about {w}?", "And {w}?", "Now {w}.", "How about {w}?"]

SYSTEM_PROMPTS = ["You are the pagedchat demo model.", "You are a helpful assistant.",
                  "You are a helpful assistant. Answer briefly.", "Be concise.",
                  "You are a tiny chat model that runs on a CPU.", "Answer the user's questions."]

IDENTITY = ("I am the pagedchat demo model, a tiny language model trained from scratch to run offline. "
            "I can do arithmetic with numbers up to 99, spell words backwards, count letters and name "
            "the capitals of 50 countries.")
SMALL_TALK = [
    (["Hello!", "Hi!", "Hi there.", "Hey.", "Hello.", "Good morning!", "Good evening.", "Hey there!"],
     "Hello! I am the pagedchat demo model. Ask me some arithmetic, a word to spell backwards, "
     "a word to count or a capital."),
    (["Who are you?", "What are you?", "Tell me about yourself.", "What is your name?",
      "Introduce yourself.", "Are you a robot?"], IDENTITY),
    (["What can you do?", "How can you help me?", "What are you good at?", "Help"],
     "I can do arithmetic with numbers up to 99, spell words backwards, count the letters of a word "
     "and name the capitals of 50 countries."),
    (["How are you?", "How are you doing?", "How is it going?"],
     "I am fine, thank you! What would you like to know?"),
    (["Thank you!", "Thanks.", "Thanks a lot!", "Great, thank you."], "You are welcome!"),
    (["Bye!", "Goodbye.", "See you later."], "Goodbye!"),
]
OUT_OF_SCOPE = [
    "What is the weather today?", "Write a poem about the sea.", "Who won the world cup?",
    "What is the meaning of life?", "Tell me a joke.", "Who is the president?", "What time is it?",
    "Translate hello into French.", "What is the square root of 2?", "Who wrote Hamlet?",
    "How far away is the moon?", "What should I cook tonight?", "Write some Python code.",
    "What is quantum physics?", "Can you book a flight for me?", "What is the population of China?",
    "How old is the universe?", "What is your favorite color?", "Recommend a good movie.",
    "Why is the sky blue?", "What year is it?", "Explain gravity.", "Who invented the telephone?",
    "What is the best programming language?", "How do I fix my car?",
]
DONT_KNOW = ("I'm sorry, I don't know that. I am a tiny demo model: I can only do arithmetic, spell words "
             "backwards, count letters and name capitals.")

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

# ----------------------------------------------------------------------------------------------
# Answers. Worked steps make the arithmetic and the letter tasks learnable for a tiny model.
# ----------------------------------------------------------------------------------------------


def _split_add(a: int, b: int) -> str:
    """'10 + 30 + 7 + 4 = 40 + 11 = 51': tens and units are one-digit facts; joining them only
    adds a possible carry of one to the tens. (a, b >= 0.)"""
    p, q, r, s = a // 10, a % 10, b // 10, b % 10
    tens, units = 10 * (p + r), q + s
    return f"{10 * p} + {10 * r} + {q} + {s} = {tens} + {units} = {a + b}"


def _split_sub(a: int, b: int) -> str:
    """'60 - 10 + 4 - 9 = 50 - 5 = 45' for a >= b: a negative units part borrows one ten."""
    p, q, r, s = a // 10, a % 10, b // 10, b % 10
    tens, units = 10 * (p - r), q - s
    join = f"{tens} + {units}" if units >= 0 else f"{tens} - {-units}"
    return f"{10 * p} - {10 * r} + {q} - {s} = {join} = {a - b}"


def add_answer(a: int, b: int) -> str:
    if a < 10 and b < 10:
        return f"{a} + {b} = {a + b}."
    return f"{a} + {b} = {_split_add(a, b)}."


def sub_answer(a: int, b: int) -> str:
    if a >= b:
        return f"{a} - {b} = {a - b}." if a < 10 else f"{a} - {b} = {_split_sub(a, b)}."
    # Negative result: subtract the other way round and flip the sign.
    inner = f"{b - a}" if b < 10 else f"{_split_sub(b, a)}"
    return f"{a} - {b} = -({b} - {a}), {b} - {a} = {inner}, so {a} - {b} = {a - b}."


def _times_digit(a: int, d: int) -> str:
    """'45 * 7 = 280 + 35 = 315': tens digit times d (with a 0) plus units digit times d."""
    return f"{a} * {d} = {a // 10 * d * 10} + {a % 10 * d} = {a * d}"


def mul_answer(a: int, b: int) -> str:
    """One-digit factors are a memorised table; larger ones are worked out in short steps."""
    if a < 10 and b < 10:
        return f"{a} * {b} = {a * b}."
    if b < 10:
        return f"{_times_digit(a, b)}."
    if a < 10:  # put the one-digit factor second
        return f"{a} * {b} = {b} * {a}, {_times_digit(b, a)}."
    tens, units = b // 10, b % 10
    return (f"{a} * {b} = {a} * {tens * 10} + {a} * {units}. {_times_digit(a, tens)}, so {a} * {tens * 10} = "
            f"{a * tens * 10}. {_times_digit(a, units)}. {_add_products(a * tens * 10, a * units)}.")


def _add_products(x: int, y: int) -> str:
    """'3780 + 252 = 3700 + 200 + 80 + 50 + 2 = 3900 + 132 = 4032' (x is a multiple of 10).

    Summing the two partial products in one go was the step a tiny model got wrong; split into
    hundreds, tens and units, each part is a one- or two-digit fact and the join adds at most one
    hundred. Zero parts are left out.
    """
    assert x % 10 == 0 and 0 <= y < 1000, (x, y)
    if y == 0:
        return f"{x} + 0 = {x}"
    parts = [100 * (x // 100), 100 * (y // 100), x % 100, 10 * (y // 10 % 10), y % 10]
    hundreds, rest = parts[0] + parts[1], parts[2] + parts[3] + parts[4]
    split = " + ".join(str(v) for v in parts if v) or "0"
    joined = " + ".join(str(v) for v in (hundreds, rest) if v) or "0"
    if joined == split:
        return f"{x} + {y} = {split} = {x + y}"
    return f"{x} + {y} = {split} = {joined} = {x + y}"


def letter_list(word: str, backwards: bool = False) -> str:
    """'1 g, 2 a, 3 r': the index makes counting trivial and lets reversal look letters up by index."""
    items = [f"{i + 1} {ch}" for i, ch in enumerate(word)]
    return ", ".join(reversed(items) if backwards else items)


# Set by set_word_pieces() from the trained tokenizer: splits " word" into its BPE pieces.
_TOKENIZER: list = []


def word_pieces(word: str) -> list[str]:
    """The word's BPE pieces as the tokenizer splits it after a space ('carrot' -> car, r, ot)."""
    tokens = _TOKENIZER[0].encode(" " + word).tokens
    pieces = [t.replace("\u0120", "") for t in tokens]
    assert "".join(pieces) == word, (word, tokens)
    return pieces


def piece_letter_list(word: str) -> str:
    """'car: 1 c, 2 a, 3 r|r: 4 r|ot: 5 o, 6 t': each BPE piece of the word, then its letters.

    Spelling a whole word from the prompt makes a tiny model keep a pointer into pieces far back,
    which it loses at repeated letters and piece boundaries. Copying one piece (the token after the
    previous piece: an induction step) and spelling it from right there keeps every look-up local.
    The first piece follows a space and the others a '|', so each one tokenizes exactly as in the
    user's word.
    """
    out, i = [], 0
    for piece in word_pieces(word):
        out.append(f"{piece}: " + ", ".join(f"{i + k + 1} {ch}" for k, ch in enumerate(piece)))
        i += len(piece)
    return "|".join(out)


# The answers never repeat the word whole: a tiny model copies a word it never saw badly, while
# spelling it piece by piece generalises.
def count_answer(w: str) -> str:
    return f"The letters are {piece_letter_list(w)}. So the word has {len(w)} letters."


def spell_answer(w: str) -> str:
    return f"The letters are {piece_letter_list(w)}. So it is spelled {'-'.join(w)}."


# The reversed word is emitted one character per token (see Tokenized.encode_answer), so it is
# written with a marker here that the encoder replaces.
REV_MARK = "\x00"


def rev_answer(w: str) -> str:
    return (f"The letters are {piece_letter_list(w)}. Backwards they are {letter_list(w, True)}. "
            f"So the word backwards is {REV_MARK}{w[::-1]}{REV_MARK}.")


def capital_answer(country: str, capital: str) -> str:
    return f"The capital of {country} is {capital}."


def first_upper(s: str) -> str:
    return s[0].upper() + s[1:]


# ----------------------------------------------------------------------------------------------
# Conversation generator
# ----------------------------------------------------------------------------------------------


@dataclass
class Turn:
    user: str
    answer: str


@dataclass
class Conversation:
    system: str | None
    turns: list = field(default_factory=list)
    family: str = ""  # family of the first turn, for reporting


@dataclass
class State:
    """What a follow-up may refer to."""
    number: int | None = None
    word: str | None = None
    country: bool = False


def style(rng: random.Random, text: str) -> str:
    """Small surface noise so users who type lower case or skip the question mark are understood."""
    r = rng.random()
    if r < 0.08:
        return text.lower()
    if r < 0.12 and text[-1] in "?.":
        return text[:-1]
    return text


CONSONANTS, VOWELS = "bcdfghjklmnprstvwz", "aeiou"


def pseudo_word(rng: random.Random) -> str:
    """A pronounceable made-up consonant-vowel word."""
    n = rng.randint(3, 9)
    vowel_first = rng.random() < 0.3
    return "".join(rng.choice(VOWELS if (i % 2 == 0) == vowel_first else CONSONANTS) for i in range(n))


def splice_word(rng: random.Random) -> str:
    """Pieces of 2-4 letters cut from training words and joined: real-word letter groups ('our',
    'ng', 'tch') in new combinations, so their BPE tokens get spelled in many contexts."""
    out = ""
    for _ in range(rng.randint(2, 3)):
        w = rng.choice(TRAIN_WORDS)
        n = min(len(w), rng.randint(2, 4))
        i = rng.randint(0, len(w) - n)
        out += w[i: i + n]
    return out[:10]


def _bigram_table() -> dict[str, list[str]]:
    """Letter successors seen in the training words ('^' starts a word, '$' ends it)."""
    table: dict[str, list[str]] = {}
    for w in TRAIN_WORDS:
        for x, y in zip("^" + w, w + "$"):
            table.setdefault(x, []).append(y)
    return table


BIGRAMS = _bigram_table()


def bigram_word(rng: random.Random) -> str:
    """A random letter string with the letter pairs of English words (a first-order chain)."""
    while True:
        out, ch = "", "^"
        while len(out) < 10:
            ch = rng.choice(BIGRAMS[ch])
            if ch == "$":
                break
            out += ch
        if len(out) >= 3:
            return out


def piece_word(rng: random.Random, pieces: list[str], lead: list[str]) -> str:
    """1-3 letter tokens of the tokenizer itself, joined: every piece a user's word can be split
    into gets its letters trained, including whole-word tokens from the templates ('city')."""
    out = rng.choice(lead) if rng.random() < 0.6 else ""
    while len(out) < 3 or (len(out) < 10 and rng.random() < 0.35):
        out += rng.choice(pieces)
    return out[:10]


# Set by set_word_pieces() from the trained tokenizer: (pieces, leading pieces).
WORD_PIECES: tuple[list[str], list[str]] = ([], [])


def set_word_pieces(tok) -> None:
    vocab = sorted(tok.get_vocab())
    pieces = [t for t in vocab if t.isalpha() and t.islower() and t.isascii()]
    lead = [t[1:] for t in vocab if t.startswith("\u0120") and t[1:].isalpha() and t[1:].islower()
            and t[1:].isascii()]
    WORD_PIECES[0][:] = pieces
    WORD_PIECES[1][:] = lead
    _TOKENIZER[:] = [tok]


def made_up_word(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.4 and WORD_PIECES[0]:
        return piece_word(rng, *WORD_PIECES)
    if r < 0.7:
        return splice_word(rng)
    if r < 0.9:
        return bigram_word(rng)
    return pseudo_word(rng)


def train_word(rng: random.Random) -> str:
    """A quarter real training words, the rest made up (never a held-out word): with only ~260 real
    words the model memorises them instead of learning to read letters off any word's pieces."""
    if rng.random() < 0.25:
        return rng.choice(TRAIN_WORDS)
    while True:
        w = made_up_word(rng)
        if w not in HELDOUT_WORDS and len(w) >= 2:
            return w


def pick_operands(rng: random.Random, heldout: bool) -> tuple[int, int]:
    """Uniform 0..99 mostly, with extra small numbers; held-out pairs only when asked for."""
    while True:
        if rng.random() < 0.25:
            a, b = rng.randint(0, 12), rng.randint(0, 99)
            if rng.random() < 0.5:
                a, b = b, a
        else:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
        if ((a, b) in HELDOUT_PAIRS) == heldout:
            return a, b


def arith_turn(rng, op, a, b, templates=None) -> Turn:
    table = {"add": (ADD_Q, add_answer), "sub": (SUB_Q, sub_answer), "mul": (MUL_Q, mul_answer)}
    qs, ans = table[op]
    q = rng.choice(templates or qs).format(a=a, b=b)
    return Turn(q, ans(a, b))


def result_of(op, a, b):
    return {"add": a + b, "sub": a - b, "mul": a * b}[op]


def fresh_turn(rng, family, st: State, heldout=False) -> Turn:
    """A question that needs no history. Updates `st` so a follow-up can refer to it."""
    st.number = st.word = None
    st.country = False
    if family in ("add", "sub", "mul"):
        a, b = pick_operands(rng, heldout)
        if family == "mul" and rng.random() < 0.3:
            b = rng.randint(0, 9)  # the one-digit table is the base of every worked product
            if (a, b) in HELDOUT_PAIRS and not heldout:
                b = (b + 1) % 10 if (a, (b + 1) % 10) not in HELDOUT_PAIRS else b
        st.number = result_of(family, a, b)
        return arith_turn(rng, family, a, b)
    if family == "capital":
        country, capital = rng.choice(CAPITALS)
        st.country = True
        return capital_question(rng, country, capital, CAP_Q)
    if family in ("rev", "count", "spell"):
        w = rng.choice(sorted(HELDOUT_WORDS)) if heldout else train_word(rng)
        st.word = w
        qs = {"rev": REV_Q, "count": COUNT_Q, "spell": SPELL_Q}[family]
        ans = {"rev": rev_answer, "count": count_answer, "spell": spell_answer}[family]
        return Turn(rng.choice(qs).format(w=w), ans(w))
    if family == "unknown_capital":
        place = rng.choice(UNKNOWN_PLACES)
        q = rng.choice(CAP_Q).format(c=place, C=first_upper(place))
        return Turn(q, f"I'm sorry, I don't know the capital of {place}.")
    if family == "smalltalk":
        qs, answer = rng.choice(SMALL_TALK)
        return Turn(rng.choice(qs), answer)
    if family == "oos":
        return Turn(rng.choice(OUT_OF_SCOPE), DONT_KNOW)
    raise ValueError(family)


def capital_question(rng, country, capital, templates) -> Turn:
    # Users may drop the article: "capital of United Kingdom".
    asked = country[4:] if country.startswith("the ") and rng.random() < 0.3 else country
    q = rng.choice(templates).format(c=asked, C=first_upper(asked))
    return Turn(q, capital_answer(country, capital))


def follow_up(rng, st: State, last_family: str) -> Turn | None:
    """A question that only makes sense with the previous turn; None if nothing to refer to."""
    if st.number is not None and 0 <= st.number <= 99:
        x = st.number
        r = rng.random()
        if r < 0.45:
            n = rng.randint(1, 99)
            st.number = x + n
            return Turn(rng.choice(PLUS_F).format(n=n), add_answer(x, n))
        if r < 0.8:
            n = rng.randint(1, 99)
            st.number = x - n
            return Turn(rng.choice(MINUS_F).format(n=n), sub_answer(x, n))
        if True:
            n = rng.randint(2, 9)
            st.number = x * n
            return Turn(rng.choice(TIMES_F).format(n=n), mul_answer(x, n))
        return None
    if st.country:
        country, capital = rng.choice(CAPITALS)
        return capital_question(rng, country, capital, CAP_F)
    if st.word is not None:
        w = st.word
        if rng.random() < 0.5:
            # Same word, other task.
            if last_family == "rev":
                return Turn(rng.choice(COUNT_F), count_answer(w))
            return Turn(rng.choice(REV_F), rev_answer(w))
        # Same task, new word.
        w2 = train_word(rng)
        st.word = w2
        ans = {"rev": rev_answer, "count": count_answer, "spell": spell_answer}[last_family]
        return Turn(rng.choice(WORD_F).format(w=w2), ans(w2))
    return None


FAMILY_WEIGHTS = {"add": 0.14, "sub": 0.17, "mul": 0.26, "capital": 0.06, "rev": 0.17, "count": 0.11,
                  "spell": 0.03, "smalltalk": 0.03, "oos": 0.015, "unknown_capital": 0.015}


def make_conversation(rng: random.Random) -> Conversation:
    system = rng.choice(SYSTEM_PROMPTS) if rng.random() < 0.2 else None
    # Up to 8 turns: REPL sessions run long, and a model that never saw a long history loses
    # track of "that" after a few turns.
    n_turns = rng.choices(range(1, 9), weights=[0.35, 0.22, 0.13, 0.1, 0.07, 0.05, 0.04, 0.04])[0]
    fams, weights = zip(*FAMILY_WEIGHTS.items())
    conv = Conversation(system)
    st, last = State(), None
    for i in range(n_turns):
        turn = None
        if i > 0 and rng.random() < 0.6:
            turn = follow_up(rng, st, last)
        if turn is None:
            last = rng.choices(fams, weights=weights)[0]
            turn = fresh_turn(rng, last, st)
        if i == 0:
            conv.family = last
        conv.turns.append(Turn(style(rng, turn.user), turn.answer))
    return conv


def plain(answer: str) -> str:
    return answer.replace(REV_MARK, "")


def messages_of(conv: Conversation, upto: int | None = None) -> list[dict]:
    """Chat messages for transformers' apply_chat_template, ending with the user turn `upto`."""
    msgs = [{"role": "system", "content": conv.system}] if conv.system else []
    turns = conv.turns if upto is None else conv.turns[: upto + 1]
    for i, t in enumerate(turns):
        msgs.append({"role": "user", "content": t.user})
        if upto is None or i < upto:
            msgs.append({"role": "assistant", "content": plain(t.answer)})
    return msgs


# ----------------------------------------------------------------------------------------------
# Held-out evaluation set (asked by pagedchat/demo/evaluate.py)
# ----------------------------------------------------------------------------------------------

# Phrasings the outside check uses, asked on held-out operand pairs.
EVAL_ARITH = [("add", "What is {a} + {b}?"), ("add", "Calculate {a} + {b}."), ("sub", "What is {a} - {b}?"),
              ("mul", "What is {a} times {b}?"), ("mul", "What is {a} * {b}?")]


def eval_set(per_family: int = 40, seed: int = 777) -> list[tuple[str, Conversation]]:
    """(family, conversation) pairs; the last turn of each conversation is the one being judged."""
    rng = random.Random(seed)
    pairs = sorted(HELDOUT_PAIRS)
    words = sorted(HELDOUT_WORDS)
    out = []
    for op, tmpl in EVAL_ARITH:
        for a, b in rng.sample(pairs, per_family):
            out.append((op, Conversation(None, [arith_turn(rng, op, a, b, [tmpl])])))
    for i in range(per_family):
        country, capital = CAPITALS[i % len(CAPITALS)]
        tmpl = CAP_Q[0] if i % 2 == 0 else rng.choice(EVAL_CAP_Q)
        out.append(("capital", Conversation(None, [capital_question(rng, country, capital, [tmpl])])))
    for i in range(per_family):
        w = words[i % len(words)]
        tmpl = rng.choice([REV_Q[0], REV_Q[1]] + EVAL_REV_Q)
        out.append(("rev", Conversation(None, [Turn(tmpl.format(w=w), rev_answer(w))])))
        tmpl = rng.choice([COUNT_Q[0]] + EVAL_COUNT_Q)
        out.append(("count", Conversation(None, [Turn(tmpl.format(w=w), count_answer(w))])))
    for i in range(per_family // 2):
        qs, answer = SMALL_TALK[i % len(SMALL_TALK)]
        out.append(("smalltalk", Conversation(None, [Turn(qs[i % len(qs)], answer)])))
    # Follow-ups: the answer needs the first turn.
    # Numeric follow-ups continue from results in 0..99, as in training.
    small = [(a, b) for a, b in pairs if 0 <= a - b and a + b <= 99]
    for i in range(per_family):
        a, b = rng.choice(small)
        op = ["add", "sub"][i % 2]
        first = arith_turn(rng, op, a, b, [EVAL_ARITH[0][1] if op == "add" else EVAL_ARITH[2][1]])
        x, n = result_of(op, a, b), rng.randint(1, 20)
        second = Turn(f"And what is that plus {n}?", add_answer(x, n))
        out.append(("followup", Conversation(None, [first, second])))
    for i in range(per_family // 2):
        (c1, k1), (c2, k2) = rng.sample(CAPITALS, 2)
        conv = Conversation(rng.choice([None, SYSTEM_PROMPTS[0]]),
                            [capital_question(rng, c1, k1, [CAP_Q[0]]),
                             capital_question(rng, c2, k2, ["What about {c}?"])])
        out.append(("followup", conv))
        w = words[(i * 7) % len(words)]
        conv = Conversation(None, [Turn(COUNT_Q[0].format(w=w), count_answer(w)),
                                   Turn("Spell it backwards.", rev_answer(w))])
        out.append(("followup", conv))
    # Long chats: a follow-up after five earlier turns (300-400 tokens of history), as in a REPL session.
    for i in range(per_family // 2):
        w1, w2 = rng.sample(words, 2)
        country, capital = rng.choice(CAPITALS)
        a, b = rng.choice(small)
        x, n = a + b, rng.randint(1, 20)
        turns = [Turn(REV_Q[0].format(w=w1), rev_answer(w1)),
                 capital_question(rng, country, capital, [CAP_Q[0]]),
                 Turn(COUNT_Q[0].format(w=w2), count_answer(w2)),
                 Turn("Spell it backwards.", rev_answer(w2)),
                 arith_turn(rng, "add", a, b, [EVAL_ARITH[0][1]]),
                 Turn(f"And what is that plus {n}?", add_answer(x, n))]
        out.append(("long", Conversation(None, turns)))
    return out


def expected_key(family: str, conv: Conversation) -> str:
    """The string a correct answer must contain (the judge in pagedchat/demo/evaluate.py)."""
    return plain(conv.turns[-1].answer)

