"""The shipped demo model answers a fixed sample of held-out prompts of every task family correctly.

Loaded from the installed package path, run greedily through transformers (the reference) and,
when the engine is importable, through pagedchat's engine, which must produce the same tokens.
The arithmetic operand pairs and the spelled/counted words here were held out of training
(see pagedchat/demo/corpus.py: HELDOUT_PAIRS, HELDOUT_WORDS). This is a regression sample the shipped
model answers right; its measured accuracy per family on all held-out prompts is in docs/demo-model.md.
"""
from __future__ import annotations

import importlib.resources
import re

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MODEL_DIR = importlib.resources.files("pagedchat") / "assets" / "demo-chat"
MAX_NEW_TOKENS = 192  # the longest answers (a 10-letter word backwards) are ~130


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


# (messages, kind, expected): "number" = the last number in the answer; "word" = appears as a word;
# "contains" = substring.
CASES = [
    ([user("What is 17 + 34?")], "number", 51),
    ([user("Calculate 6 + 59.")], "number", 65),
    ([user("What is 15 - 3?")], "number", 12),
    ([user("What is 9 - 64?")], "number", -55),
    ([user("What is 7 times 21?")], "number", 147),
    ([user("What is 12 * 36?")], "number", 432),
    ([user("What is the capital of France?")], "contains", "Paris"),
    ([user("Which city is the capital of Kenya?")], "contains", "Nairobi"),
    ([user("Spell the word flower backwards.")], "word", "rewolf"),
    ([user("Reverse the word tower.")], "word", "rewot"),
    ([user("Spell the word journey backwards.")], "word", "yenruoj"),
    ([user("Spell the word violin backwards.")], "word", "niloiv"),
    ([user("Reverse the word pepper.")], "word", "reppep"),
    ([user("Spell the word language backwards.")], "word", "egaugnal"),
    ([user("How many letters are in the word sister?")], "number", 6),
    ([user("How many letters are in the word happy?")], "number", 5),
    ([user("How many letters are in the word carrot?")], "number", 6),
    ([user("How many letters are in the word holiday?")], "number", 7),
    ([user("How many letters are in the word thunder?")], "number", 7),
    ([user("Who are you?")], "contains", "pagedchat"),
    ([user("What is 25 + 17?"), assistant("25 + 17 = 20 + 10 + 5 + 7 = 30 + 12 = 42."), user("And what is that plus 10?")], "number", 52),
    ([user("What is the capital of Spain?"), assistant("The capital of Spain is Madrid."),
      user("What about Germany?")], "contains", "Berlin"),
    # A REPL-length chat, ~360 tokens: "that" is the result of the turn before (the judged step is the
    # follow-up; the spelled words are held out, the sum in the history need not be).
    ([user("Spell the word sister backwards."),
      assistant("The letters are s: 1 s|ist: 2 i, 3 s, 4 t|er: 5 e, 6 r. Backwards they are 6 r, 5 e, 4 t, 3 s, "
                "2 i, 1 s. So the word backwards is retsis."),
      user("What is the capital of Japan?"), assistant("The capital of Japan is Tokyo."),
      user("How many letters are in the word tower?"),
      assistant("The letters are t: 1 t|ow: 2 o, 3 w|er: 4 e, 5 r. So the word has 5 letters."),
      user("Spell it backwards."),
      assistant("The letters are t: 1 t|ow: 2 o, 3 w|er: 4 e, 5 r. Backwards they are 5 r, 4 e, 3 w, 2 o, 1 t. "
                "So the word backwards is rewot."),
      user("What is 31 + 25?"), assistant("31 + 25 = 30 + 20 + 1 + 5 = 50 + 6 = 56."),
      user("And what is that plus 12?")], "number", 68),
]


def correct(kind, expected, text):
    if kind == "number":
        nums = re.findall(r"-?\d+", text)
        return bool(nums) and int(nums[-1]) == expected
    if kind == "word":
        return re.search(rf"\b{expected}\b", text) is not None
    return expected in text


@pytest.fixture(scope="module")
def tokenizer():
    assert (MODEL_DIR / "config.json").is_file(), f"demo model missing from the package: {MODEL_DIR}"
    return transformers.AutoTokenizer.from_pretrained(str(MODEL_DIR))


@pytest.fixture(scope="module")
def prompts(tokenizer):
    out = []
    for messages, _, _ in CASES:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if not isinstance(ids, list) else ids))
    return out


def stop_ids(tokenizer):
    return [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.pad_token_id]


def strip_stop(ids, stops):
    for i, t in enumerate(ids):
        if t in stops:
            return ids[:i]
    return ids


@pytest.fixture(scope="module")
def hf_answers(tokenizer, prompts):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32).eval()
    stops = stop_ids(tokenizer)
    answers = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=MAX_NEW_TOKENS, eos_token_id=stops, pad_token_id=stops[1])
            answers.append(strip_stop(y[0, len(ids):].tolist(), stops))
    return answers


def test_shipped_files_are_small_and_half_precision():
    files = {p.name: p for p in MODEL_DIR.iterdir()}
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json"):
        assert name in files, name
    assert sum(p.stat().st_size for p in files.values() if p.is_file()) < 15 * 2**20
    from safetensors import safe_open

    with safe_open(str(MODEL_DIR / "model.safetensors"), "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes <= {"F16", "BF16"}, dtypes


def test_chat_template(tokenizer):
    text = tokenizer.apply_chat_template([user("Hi")], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>"


@pytest.mark.parametrize("case", range(len(CASES)))
def test_transformers_greedy_answer_is_correct(case, tokenizer, hf_answers):
    messages, kind, expected = CASES[case]
    text = tokenizer.decode(hf_answers[case], skip_special_tokens=True)
    assert correct(kind, expected, text), f"{messages[-1]['content']!r} -> {text!r} (want {expected!r})"


def test_pagedchat_engine_matches_transformers(tokenizer, prompts, hf_answers):
    engine_mod = pytest.importorskip("pagedchat.engine")
    eng = engine_mod.Engine(engine_mod.EngineConfig(model=str(MODEL_DIR), device="cpu", dtype="float32",
                                                    kv_memory="64MiB"))
    stops = stop_ids(tokenizer)
    params = engine_mod.SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, stop_token_ids=stops)
    outs = eng.generate(prompts, params)  # all at once: the batched path
    got = [strip_stop(list(o.outputs[0].token_ids), stops) for o in outs]
    for (messages, _, _), a, b in zip(CASES, hf_answers, got):
        assert a == b, f"{messages[-1]['content']!r}: transformers {tokenizer.decode(a)!r} vs pagedchat {tokenizer.decode(b)!r}"
