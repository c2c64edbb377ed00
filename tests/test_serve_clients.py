"""What real clients ask of the server, driven by the official openai client: logprobs and echo (checked
against transformers' log_softmax: token-id prompts and lists of them, as lm-eval sends them; chat
top_logprobs; streaming equal to non-streaming), structured output (every output validates)."""

import json

import httpx
import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel, Field

from serve_util import serving_model

NAME = "tiny"
PROMPTS = [[5, 17, 40, 99, 123, 7, 250, 31, 64], [9, 44, 101, 6, 260, 33, 12, 12, 90, 18, 200]]


@pytest.fixture(scope="module")
def server(model_dirs):
    with serving_model(model_dirs["llama"][0], NAME) as (url, engine):
        yield url, engine.tokenizer, model_dirs["llama"][1]


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0], api_key="none", timeout=60, max_retries=0)


def reference(hf, ids):
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_echo_logprobs_of_token_id_prompts_equal_transformers(server, client):
    """lm-eval's log-likelihood request: a batch of token-id prompts, max_tokens 1, logprobs 1, echo."""
    url, tokenizer, hf = server
    out = client.completions.create(model=NAME, prompt=PROMPTS, max_tokens=1, logprobs=1, echo=True,
                                    temperature=0)
    assert len(out.choices) == 2
    for prompt, choice in zip(PROMPTS, sorted(out.choices, key=lambda c: c.index)):
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(prompt) + 1 and lp.token_logprobs[0] is None
        assert lp.top_logprobs[0] is None
        generated = reference(hf, prompt)[-1].argmax().item()
        full = prompt + [generated]
        ref = reference(hf, full)
        expected = [ref[p, full[p + 1]].item() for p in range(len(full) - 1)]
        assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
        assert choice.text.startswith(tokenizer.decode(prompt))
        assert lp.tokens == [tokenizer.decode([t]) for t in full]
        # the chosen token is always among the top entries; greedy means it is the best one
        assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_completion_stream_with_echo_equals_full_response(server, client):
    kw = dict(model=NAME, prompt=PROMPTS[1], max_tokens=5, logprobs=3, echo=True, temperature=0)
    full = client.completions.create(**kw).choices[0]
    text, tokens, logprobs = "", [], []
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                logprobs += c.logprobs.token_logprobs
    assert text == full.text
    assert tokens == full.logprobs.tokens
    assert logprobs == full.logprobs.token_logprobs


def test_chat_logprobs_and_top_logprobs(server, client):
    hf = server[2]
    kw = dict(model=NAME, messages=[{"role": "user", "content": "hello world"}], max_tokens=6, temperature=0,
              logprobs=True, top_logprobs=4)
    out = client.chat.completions.create(**kw)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert all(len(c.top_logprobs) == 4 and c.logprob == c.top_logprobs[0].logprob for c in content)
    assert "".join(c.token for c in content) == out.choices[0].message.content
    streamed = [c for chunk in client.chat.completions.create(stream=True, **kw) for choice in chunk.choices
                if choice.logprobs is not None for c in choice.logprobs.content]
    # the same tokens; the log-probabilities to float rounding: the second request reuses the first one's cached
    # prompt blocks (attention over cached KV sums in another order than one whole prefill)
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-5)
    plain = client.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"prompt": "hi", "logprobs": 30}, "logprobs"),
])
def test_bad_logprobs_requests_are_400(server, body, param):
    path = "/chat/completions" if "messages" in body else "/completions"
    r = httpx.post(server[0] + path, json={"model": NAME, **body}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "role": {"enum": ["admin", "user"]}},
          "required": ["name", "age", "role"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


def test_json_schema_chat_variants_and_stream_validate(client):
    kw = dict(model=NAME, messages=[{"role": "user", "content": "who?"}], max_tokens=80, temperature=1.0, seed=2,
              response_format=JSON_SCHEMA)
    out = client.chat.completions.create(n=3, **kw)
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                   if c.choices)
    jsonschema.validate(json.loads(text), PERSON)


def test_json_schema_on_completions_and_json_object(client):
    out = client.completions.create(model=NAME, prompt="hello", max_tokens=80, temperature=0,
                                    extra_body={"response_format": JSON_SCHEMA})
    jsonschema.validate(json.loads(out.choices[0].text), PERSON)
    out = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=10,
                                         response_format={"type": "json_object"}, temperature=0)
    assert out.choices[0].message.content.startswith("{")


class Pet(BaseModel):
    name: str = Field(max_length=6)
    legs: int = Field(ge=0, le=8)


def test_openai_parse_helper_with_a_pydantic_model(client):
    """The client's own strict-schema helper: it builds the schema, the server enforces it, the client parses."""
    out = client.chat.completions.parse(model=NAME, messages=[{"role": "user", "content": "a pet"}], max_tokens=60,
                                        temperature=0, response_format=Pet)
    pet = out.choices[0].message.parsed
    assert isinstance(pet, Pet) and 0 <= pet.legs <= 8


@pytest.mark.parametrize("response_format,message", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"$ref": "#/missing"}}}}}, "unsupported json schema"),
    ({"type": "xml"}, "not supported"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}, "schema"),
])
def test_unsupported_response_format_is_400(server, response_format, message):
    r = httpx.post(server[0] + "/chat/completions", timeout=30, json={
        "model": NAME, "messages": [{"role": "user", "content": "hi"}], "response_format": response_format})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith("response_format") and message in error["message"]


# -- embeddings and usage ---------------------------------------------------------------------------------------
def test_embeddings_are_mean_pooled_last_hidden_states(server, client):
    tokenizer, hf = server[1], server[2]
    texts = ["hello world", "the quick brown fox jumps over the lazy dog"]
    out = client.embeddings.create(model=NAME, input=texts)
    ids_out = client.embeddings.create(model=NAME, input=[PROMPTS[0]])
    assert [d.index for d in out.data] == [0, 1]
    for text, item in zip(texts + [PROMPTS[0]], out.data + ids_out.data):
        ids = tokenizer(text).input_ids if isinstance(text, str) else text
        with torch.no_grad():
            ref = hf.model(torch.tensor([ids])).last_hidden_state[0].mean(dim=0)
        assert item.embedding == pytest.approx(ref.tolist(), abs=1e-4)
    assert out.usage.prompt_tokens == sum(len(tokenizer(t).input_ids) for t in texts)
    floats = httpx.post(server[0] + "/embeddings", json={"model": NAME, "input": "hello world"}, timeout=30).json()
    assert floats["data"][0]["embedding"] == pytest.approx(out.data[0].embedding, abs=1e-6)  # the client used base64


def test_stream_options_include_usage_on_both_endpoints(client):
    chunks = list(client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    chunks = list(client.completions.create(model=NAME, prompt="hi", max_tokens=3, stream=True, n=2,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 6 and all(c.usage is None for c in chunks[:-1])
