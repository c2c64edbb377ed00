"""`pagedchat serve`'s POST /tokenize and /detokenize in vLLM's shapes: a prompt's ids are what /v1/completions
feeds the model, messages' ids what /v1/chat/completions does (compared through the server itself); bad
requests are 400s in OpenAI's error shape. On the shipped demo model, and on a copy of it whose tokenizer adds
a BOS token (add_special_tokens only shows on such a tokenizer)."""

from __future__ import annotations

import importlib.resources
import json
import shutil

import httpx
import pytest

from serve_util import serving_model

DEMO = importlib.resources.files("pagedchat") / "assets" / "demo-chat"
KEY = "tokenize-key"
NAME = "demo"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "what is 2 + 3?"},
        {"role": "assistant", "content": "5"}, {"role": "user", "content": "and 4 + 4?"}]
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    with serving_model(DEMO, NAME, api_key=KEY) as (url, engine):
        yield url.removesuffix("/v1"), engine


@pytest.fixture(scope="module")
def bos_server(tmp_path_factory):
    """The demo model with a tokenizer that starts every encoding with <|endoftext|> (id 0) as its BOS."""
    path = tmp_path_factory.mktemp("bos") / "demo-bos"
    shutil.copytree(DEMO, path)
    spec = json.loads((path / "tokenizer.json").read_text())
    bos = {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}}}
    (path / "tokenizer.json").write_text(json.dumps(spec))
    with serving_model(path, NAME) as (url, engine):
        assert engine.tokenizer("hi").input_ids[0] == 0
        yield url.removesuffix("/v1"), engine


def post(server, path: str, body: dict, headers=AUTH) -> httpx.Response:
    return httpx.post(server[0] + path, json=body, headers=headers, timeout=60)


def tokenize(server, **body) -> dict:
    r = post(server, "/tokenize", body)
    assert r.status_code == 200, r.text
    return r.json()


def chat_prompt(server, messages) -> tuple[list[int], int]:
    """(prompt_token_ids, usage.prompt_tokens) of a chat completion of these messages."""
    r = post(server, "/v1/chat/completions", {"model": NAME, "messages": messages, "max_tokens": 2,
                                              "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["prompt_token_ids"], r.json()["usage"]["prompt_tokens"]


def completion_prompt(server, prompt: str) -> tuple[list[int], int]:
    r = post(server, "/v1/completions", {"model": NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0,
                                         "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["prompt_token_ids"], r.json()["usage"]["prompt_tokens"]


def template_ids(tokenizer, messages, add_generation_prompt: bool = True) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


# -- /tokenize ---------------------------------------------------------------------------------------------------
def test_a_prompt_is_encoded_as_completions_encode_it(server):
    reply = tokenize(server, model=NAME, prompt="hello world, paged attention")
    tokenizer = server[1].tokenizer
    assert reply["tokens"] == tokenizer("hello world, paged attention").input_ids
    assert reply["count"] == len(reply["tokens"]) and reply["max_model_len"] == server[1].max_model_len
    assert set(reply) == {"tokens", "count", "max_model_len"}
    ids, prompt_tokens = completion_prompt(server, "hello world, paged attention")
    assert ids == reply["tokens"] and prompt_tokens == reply["count"]


def test_messages_are_the_chat_completions_prompt(server):
    for messages in (CHAT[1:2], CHAT):
        reply = tokenize(server, messages=messages)       # no "model": optional, as in vLLM
        assert reply["tokens"] == template_ids(server[1].tokenizer, messages)
        ids, prompt_tokens = chat_prompt(server, messages)
        assert ids == reply["tokens"] and prompt_tokens == reply["count"]


def test_add_generation_prompt_and_token_strings(server):
    tokenizer = server[1].tokenizer
    without = tokenize(server, messages=CHAT, add_generation_prompt=False)["tokens"]
    assert without == template_ids(tokenizer, CHAT, add_generation_prompt=False)
    assert without != tokenize(server, messages=CHAT)["tokens"]
    reply = tokenize(server, prompt="two words", return_token_strs=True)
    assert reply["token_strs"] == tokenizer.convert_ids_to_tokens(reply["tokens"])


def test_add_special_tokens_defaults_as_vllms(bos_server):
    """A prompt gets BOS unless add_special_tokens is false; messages do not (the template writes the
    prompt), unless it is true; either way the default is what the completion endpoints feed the model."""
    prompt = tokenize(bos_server, prompt="hello")["tokens"]
    assert prompt[0] == 0 and tokenize(bos_server, prompt="hello", add_special_tokens=False)["tokens"] == prompt[1:]
    assert completion_prompt(bos_server, "hello")[0] == prompt
    chat = tokenize(bos_server, messages=CHAT)["tokens"]
    assert chat[0] != 0 and chat == template_ids(bos_server[1].tokenizer, CHAT)
    assert chat_prompt(bos_server, CHAT)[0] == chat
    assert tokenize(bos_server, messages=CHAT, add_special_tokens=True)["tokens"] == [0] + chat


# -- /detokenize -------------------------------------------------------------------------------------------------
def test_detokenize_inverts_tokenize(server):
    ids = tokenize(server, messages=CHAT)["tokens"]
    r = post(server, "/detokenize", {"model": NAME, "tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": server[1].tokenizer.decode(ids)}
    assert r.json()["prompt"].startswith("<|im_start|>system\nBe brief.")     # special tokens kept
    assert post(server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


# -- bad requests ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"model": NAME}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "temprature": 1}, "temprature"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, "tokens[0]"),
    ("/detokenize", {"tokens": [1.5]}, "tokens[0]"),
    ("/detokenize", {"tokens": ["5"]}, "tokens[0]"),
    ("/detokenize", {"tokens": [5, 10 ** 6]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
])
def test_bad_requests_are_400_in_openais_shape(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_an_unknown_model_is_404_and_the_key_is_required(server):
    r = post(server, "/tokenize", {"model": "nope", "prompt": "a"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [5]})):
        r = post(server, path, body, headers={})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
