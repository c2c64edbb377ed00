"""`pagedchat bench accuracy`: what each quantized mode costs in accuracy, measured against the unquantized
model in the same run.

Modes: fp (the unquantized model: the reference, and its row is the control), int8 and int4
(`--quantize`, weights), kv-int8 and kv-fp8 (`--kv-dtype`, the KV pool; in builds that have it). Per mode:

  - greedy agreement: a few prompts, `tokens` greedy tokens each (EOS ignored), compared with the reference's:
    the first position where they differ, and the share of tokens before it. After one differing token the
    continuations differ by construction, so tokens after the first divergence are not compared.
  - perplexity of a fixed text, scored by the engine as it scores an echoed prompt (prefill, `prompt_logprobs`)
    in windows of the model's context: for the demo model, the replies of conversations of its own kind (its
    corpus generator, rendered by its template; the users' turns are context, not scored: they hold random
    held-out numbers and words no model predicts); for any other model, a shipped public-domain passage.
  - the demo model's held-out questions (pagedchat/demo/evaluate.py): the eval script's set and as many new
    ones of the same kinds, judged per family, and how many replies are token-identical to the reference's.
  - the largest logit error, teacher-forced on the reference's greedy tokens the way the engine runs them
    (bench/int8_accuracy.py), in logits and relative to the reference logits' spread, and how many greedy
    divergences fell at a near-tie (the reference's top-2 gap there at most twice the error there).

`--peer llama.cpp` adds llama.cpp's perplexity of the same token windows through llama-cpp-python on the same
weights written as GGUF (F32, Q8_0, Q4_0), so int4's increase over fp can be set beside Q4_0's over F32.
"""

from __future__ import annotations

import gc
import math
import random
from importlib import resources
from pathlib import Path

from pagedchat.errors import UserError

MODES = {"fp": {}, "int8": {"quantize": "int8"}, "int4": {"quantize": "int4"},
         "kv-int8": {"kv_dtype": "int8"}, "kv-fp8": {"kv_dtype": "fp8"}, "file": {}}
# On a GGUF file, fp is its weights dequantized and `file` runs them in the file's own block formats.
GGUF_MODES = {"fp": {"quantize": "none"}, "file": {}}
EVAL_SEEDS = (777, 778)  # 777: scripts/eval_demo_model.py's questions; 778: new ones of the same kinds
# Public domain (Lewis Carroll, 1865): the opening of Alice's Adventures in Wonderland.
PROSE = ("assets", "text", "alice.txt")
# A real model's text also has the Declaration of Independence (1776, public domain): 2.4k tokens together.
LONG_PROSE = (PROSE, ("assets", "text", "declaration.txt"))
DEMO_TEXT_CONVERSATIONS = 120
DEMO_TEXT_SEED = 4242


def mode_settings(mode: str, gguf: bool = False) -> dict:
    """EngineConfig fields of a mode; one clear line for a mode this build cannot run."""
    from dataclasses import fields

    from pagedchat.engine import EngineConfig

    if mode not in MODES or (mode == "file") != (gguf and mode == "file"):
        raise UserError(f"--modes takes {', '.join(m for m in MODES if gguf or m != 'file')}; got {mode!r}")
    if gguf and mode in GGUF_MODES:
        return GGUF_MODES[mode]
    missing = set(MODES[mode]) - {f.name for f in fields(EngineConfig)}
    if missing:
        raise UserError(f"mode {mode} needs --kv-dtype, which this build does not have")
    return MODES[mode]


def _engine(path: Path, device: str, mode: str, max_len: int):
    from pagedchat.engine import Engine, EngineConfig

    # No prefix cache: the teacher-forced passes write into the pool's first blocks directly.
    config = EngineConfig(model=str(path), device=device, kv_memory="256MiB", max_model_len=max_len,
                          enable_prefix_cache=False, **mode_settings(mode, _is_gguf(path)))
    return Engine(config, show_progress=False)


# -- what is measured -------------------------------------------------------------------------------------------
def greedy_agreement(reference: list[list[int]], got: list[list[int]]) -> dict:
    first = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r)) for r, g in zip(reference, got)]
    total = sum(len(r) for r in reference)
    return {"first_divergence": first, "tokens_agreeing": sum(first) / total,
            "prompts_identical": sum(f == len(r) for f, r in zip(first, reference)), "prompts": len(reference)}


Window = tuple[list[int], list[bool]]  # token ids, and whether each is scored (the first never is)


def perplexity(engine, windows: list[Window]) -> float:
    """exp of the mean negative log-likelihood of the scored tokens."""
    from pagedchat.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    nll = count = 0
    for out, (_, scored) in zip(engine.generate([ids for ids, _ in windows], params), windows):
        # prompt_logprobs[i] scores token i + 1
        nll -= sum(s.logprob for s, keep in zip(out.prompt_logprobs, scored[1:]) if keep)
        count += sum(scored[1:])
    return math.exp(nll / count)


def text_windows(tokens: list[int], scored: list[bool], window: int) -> list[Window]:
    """Non-overlapping windows of `window` tokens (a shorter last one if it scores anything)."""
    out = [(tokens[i:i + window], scored[i:i + window]) for i in range(0, len(tokens), window)]
    return [(ids, keep) for ids, keep in out if any(keep[1:])]


def demo_text(tokenizer) -> tuple[list[int], list[bool]]:
    """Conversations of the demo model's own kind (its corpus generator, a fixed seed), rendered by its chat
    template and concatenated; the assistant's replies (through their end-of-turn token) are scored."""
    from pagedchat.demo import corpus as T

    T.set_word_pieces(tokenizer.backend_tokenizer)
    rng = random.Random(DEMO_TEXT_SEED)
    ids: list[int] = []
    scored: list[bool] = []
    for _ in range(DEMO_TEXT_CONVERSATIONS):
        conv = T.make_conversation(rng)
        done = 0
        for turn in range(len(conv.turns)):
            start = len(_ids(tokenizer.apply_chat_template(T.messages_of(conv, upto=turn),
                                                           add_generation_prompt=True, tokenize=True)))
            upto = T.messages_of(conv)[:len(T.messages_of(conv, upto=turn)) + 1]
            end = _ids(tokenizer.apply_chat_template(upto, tokenize=True))
            ids += end[done:]
            scored += [False] * (start - done) + [True] * (len(end) - start)
            done = len(end)
    return ids, scored


def prose_text(tokenizer, long: bool = False) -> tuple[list[int], list[bool]]:
    files = LONG_PROSE if long else (PROSE,)
    text = "\n\n".join(resources.files("pagedchat").joinpath(*f).read_text().strip() for f in files)
    ids = _ids(tokenizer(text).input_ids)
    return ids, [True] * len(ids)


def _ids(x) -> list[int]:
    return list(x if isinstance(x, list) else x["input_ids"])


def demo_questions(tokenizer, per_family: int):
    from pagedchat.demo.evaluate import build_prompts

    return [item for seed in EVAL_SEEDS for item in build_prompts(tokenizer, per_family, seed=seed)]


def answer_questions(engine, items, tokenizer) -> list[list[int]]:
    from pagedchat.demo.evaluate import MAX_NEW_TOKENS, stop_ids, strip_stop
    from pagedchat.engine import SamplingParams

    stops = stop_ids(tokenizer)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, stop_token_ids=stops)
    return [strip_stop(list(r.outputs[0].token_ids), stops) for r in engine.generate([i[2] for i in items], params)]


# -- the run ------------------------------------------------------------------------------------------------------
def _is_demo(path: Path) -> bool:
    from pagedchat.demo.evaluate import DEFAULT_MODEL

    return Path(str(DEFAULT_MODEL)).resolve() == Path(path).resolve()


def _tokenizer(path: Path):
    from pagedchat.model.loader import load_tokenizer

    if _is_gguf(path) or (Path(path) / "tokenizer.json").exists():
        return load_tokenizer(Path(path), False, None)
    return None


def _is_gguf(path: Path) -> bool:
    from pagedchat.model.gguf.locate import looks_like_gguf

    return Path(path).is_file() and looks_like_gguf(Path(path))


def _limits(path: Path) -> tuple[int, int]:
    """(context length, vocabulary size) of a model folder or a GGUF file."""
    if _is_gguf(path):
        from pagedchat.model.gguf.arch import config_from_gguf
        from pagedchat.model.gguf.locate import resolve_gguf
        from pagedchat.model.gguf.reader import open_gguf

        config = config_from_gguf(open_gguf(resolve_gguf(str(path))))
    else:
        from pagedchat.model.loader import load_config

        config = load_config(Path(path), False)
    return config.max_position_embeddings, config.vocab_size


def _greedy_prompts(tokenizer, items, vocab: int, count: int, seed: int) -> list[list[int]]:
    """Chat prompts (the demo's questions, or short instructions) with a tokenizer, random ids without."""
    if items:
        step = max(1, len(items) // count)
        return [items[i * step][2] for i in range(count)]
    rng = random.Random(seed)
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return [_ids(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                   tokenize=True)) for q in (INSTRUCTIONS * count)[:count]]
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 64))] for _ in range(count)]


INSTRUCTIONS = ["Tell me a short story about a cat.", "What is the capital of France?", "Count from one to ten.",
                "Why is the sky blue?", "Write a haiku about rain.", "Name three colours.", "Hello! Who are you?",
                "What is 17 + 25?"]


def run_accuracy_bench(path: Path, name: str, modes: list[str], device: str = "cpu", tokens: int = 256,
                       prompts: int = 6, per_family: int = 30, peer: str | None = None, seed: int = 0) -> dict:
    """Every mode against "fp" (always run first, as the reference) on the same prompts, text and questions.
    On a GGUF file, fp is the file's weights dequantized, `file` its own block formats, and the llama.cpp peer
    scores the same file."""
    gguf = _is_gguf(path)
    for mode in modes:
        mode_settings(mode, gguf)
    modes = ["fp"] + [m for m in dict.fromkeys(modes) if m != "fp"]
    limit, vocab = _limits(path)
    tokenizer = _tokenizer(path)
    demo = tokenizer is not None and _is_demo(path)
    items = demo_questions(tokenizer, per_family) if demo else []
    greedy = _greedy_prompts(tokenizer, items, vocab, prompts, seed)
    tokens = min(tokens, limit - max(len(p) for p in greedy))
    window = min(limit - 1, 512)  # one position left for the token the scoring request generates
    text = (demo_text(tokenizer) if demo else prose_text(tokenizer, long=gguf)) if tokenizer is not None \
        else ([], [])
    windows = text_windows(*text, window)
    result = {"model": name, "device": device, "modes": {}, "greedy_tokens": tokens, "greedy_prompts": len(greedy),
              "text": {"kind": "demo conversations' replies" if demo else ("prose" if windows else None),
                       "tokens": sum(len(w) for w, _ in windows),
                       "scored": sum(sum(keep[1:]) for _, keep in windows), "window": window},
              "questions": len(items)}
    reference: dict = {}
    for mode in modes:
        engine = _engine(Path(path), device, mode, limit)
        row = _measure(engine, greedy, tokens, windows, items, tokenizer, reference)
        row.update(_logit_error(engine, greedy, row["greedy"]["first_divergence"], reference))
        result["modes"][mode] = row
        del engine
        gc.collect()
    fp = result["modes"]["fp"].get("perplexity")
    for row in result["modes"].values():
        if fp and row.get("perplexity"):
            row["perplexity_increase"] = row["perplexity"] / fp - 1
    if peer is not None:
        result["llama.cpp"] = llama_cpp_file_perplexity(Path(path), windows) if gguf else \
            llama_cpp_perplexity(Path(path), windows)
    return result


def _measure(engine, greedy, tokens, windows, items, tokenizer, reference: dict) -> dict:
    """One mode's row; the first call (fp) fills `reference` with what later modes are compared against."""
    from pagedchat.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in engine.generate(greedy, params)]
    reference.setdefault("greedy", outs)
    row = {"greedy": greedy_agreement(reference["greedy"], outs)}
    if windows:
        row["perplexity"] = perplexity(engine, windows)
    if items:
        answers = answer_questions(engine, items, tokenizer)
        reference.setdefault("answers", answers)
        from pagedchat.demo.evaluate import score

        per = score(items, answers, tokenizer)
        right = [ok for oks in per.values() for ok in oks]
        row["questions"] = {"accuracy": sum(right) / len(right), "right": sum(right),
                            "per_family": {f: sum(v) / len(v) for f, v in per.items()},
                            "identical_to_fp": sum(a == b for a, b in zip(answers, reference["answers"]))}
    return row


def _logit_error(engine, greedy, first_divergence, reference: dict) -> dict:
    """Teacher-forced on the reference's tokens; the reference's logits are kept from its own pass (on CPU)."""
    from pagedchat.bench.int8_accuracy import teacher_forced_logits

    forced = [teacher_forced_logits(engine, p, r).float().cpu() for p, r in zip(greedy, reference["greedy"])]
    ref = reference.setdefault("logits", forced)
    max_err = rel_err = 0.0
    near_ties = 0
    for fp, got, first, cont in zip(ref, forced, first_divergence, reference["greedy"]):
        err = (got - fp).abs().amax(dim=-1)
        spread = fp.amax(dim=-1) - fp.amin(dim=-1)
        max_err, rel_err = max(max_err, err.max().item()), max(rel_err, (err / spread).max().item())
        if first < len(cont):
            top2 = fp[first].topk(2).values
            near_ties += int((top2[0] - top2[1]).item() <= 2 * err[first].item())
    return {"max_logit_error": max_err, "max_logit_error_rel_spread": rel_err, "divergences_at_near_ties": near_ties}


# -- the llama.cpp peer -----------------------------------------------------------------------------------------
LLAMA_CPP_PPL_TYPES = ("F32", "Q8_0", "Q4_0")


def llama_cpp_file_perplexity(path: Path, windows: list[Window]) -> dict:
    """llama.cpp's perplexity of the same windows on the same GGUF file, in its own formats: with its default
    float16 KV cache, and with a float32 one (the precision of pagedchat's pool on CPU: Gemma 3 270M's
    perplexity moves 2% between the two in llama.cpp)."""
    from pagedchat.bench.batch1 import llama_cpp_available

    if not llama_cpp_available():
        return {"note": "llama.cpp peer skipped: llama-cpp-python is not installed (pip install llama-cpp-python)"}
    return {"file": {"perplexity": _llama_cpp_windows_perplexity(path, windows)},
            "file, f32 KV": {"perplexity": _llama_cpp_windows_perplexity(path, windows, kv_f32=True)}}


def _llama_cpp_windows_perplexity(path: Path, windows: list[Window], kv_f32: bool = False) -> float:
    import numpy as np
    from llama_cpp import Llama

    kv = {"type_k": 0, "type_v": 0} if kv_f32 else {}   # ggml type 0 = F32 (llama.cpp's default: F16)
    llm = Llama(model_path=str(path), n_ctx=max(len(w) for w, _ in windows), n_batch=512, logits_all=True,
                verbose=False, **kv)
    nll = count = 0
    for ids, scored in windows:
        llm.reset()
        llm.eval(ids)
        logits = np.asarray(llm.scores[:len(ids) - 1], dtype=np.float64)  # row i predicts token i + 1
        top = logits.max(axis=1, keepdims=True)
        logz = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
        keep = np.asarray(scored[1:])
        nll += float((logz - logits[np.arange(len(ids) - 1), ids[1:]])[keep].sum())
        count += int(keep.sum())
    del llm
    return math.exp(nll / count)


def llama_cpp_perplexity(model_dir: Path, windows: list[Window]) -> dict:
    """llama.cpp's perplexity of the same windows for each GGUF type, with Q/K rows in its rotary layout so its
    logits are the model's. The embedding stays F32 and the LM head takes the type, as in our int modes."""
    import tempfile

    from pagedchat.bench.batch1 import llama_cpp_available, write_gguf

    if not llama_cpp_available():
        return {"note": "llama.cpp peer skipped: llama-cpp-python (and gguf) are not installed "
                        "(pip install llama-cpp-python gguf)"}
    if not windows:
        return {"note": "llama.cpp peer skipped: the model has no tokenizer, so there is no text to score"}
    out = {}
    with tempfile.TemporaryDirectory(prefix="pagedchat-accuracy-") as tmp:
        for kind in LLAMA_CPP_PPL_TYPES:
            gguf = write_gguf(model_dir, Path(tmp) / f"model-{kind}.gguf", kind, exact=True)
            out[kind] = {"perplexity": _llama_cpp_windows_perplexity(gguf, windows)}
    for kind in LLAMA_CPP_PPL_TYPES:
        out[kind]["perplexity_increase"] = out[kind]["perplexity"] / out["F32"]["perplexity"] - 1
    return out


def print_accuracy_report(r: dict) -> None:
    from pagedchat.bench.common import print_table

    rows = []
    for mode, m in r["modes"].items():
        g, q = m["greedy"], m.get("questions")
        rows.append([mode, f"{g['tokens_agreeing']:.1%}", f"{g['prompts_identical']}/{g['prompts']}",
                     " ".join(str(f) for f in g["first_divergence"]),
                     f"{m['divergences_at_near_ties']}/{g['prompts'] - g['prompts_identical']}",
                     f"{m['max_logit_error']:.4f} ({m['max_logit_error_rel_spread']:.2%})",
                     f"{m['perplexity']:.4f}" if "perplexity" in m else "-",
                     f"{m['perplexity_increase']:+.2%}" if "perplexity_increase" in m else "-",
                     f"{q['accuracy']:.1%} ({q['right']}/{r['questions']})" if q else "-",
                     f"{q['identical_to_fp']}/{r['questions']}" if q else "-"])
    text = r["text"]
    print_table(f"Accuracy against fp — {r['model']} on {r['device']}: {r['greedy_prompts']} prompts x "
                f"{r['greedy_tokens']} greedy tokens; perplexity of {text['scored']} tokens ({text['kind']}, "
                f"windows of {text['window']})", ["mode", "greedy tokens agreeing", "prompts identical",
                                                  "first divergence", "at a near-tie", "max logit error (/ spread)",
                                                  "perplexity", "vs fp", "questions right", "answers = fp's"], rows,
                caption="tokens agreeing: up to each prompt's first divergence")
    peer = r.get("llama.cpp")
    if peer and "note" in peer:
        print(peer["note"])
    elif peer and "file" in peer:
        ours = r["modes"].get("file", r["modes"]["fp"]).get("perplexity")
        print("llama.cpp on the same file and windows: " + ", ".join(
            f"{kind} {v['perplexity']:.4f}" + (f" (pagedchat / llama.cpp = {ours / v['perplexity']:.4f})" if ours else "")
            for kind, v in peer.items()))
    elif peer:
        print("llama.cpp on the same windows: " + ", ".join(
            f"{k} {v['perplexity']:.4f} ({v['perplexity_increase']:+.2%})" for k, v in peer.items()))
