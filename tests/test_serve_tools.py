"""Tool calls through the server with the openai client: tools rendered by a Hermes-style chat template, a
required or named call is grammar-constrained (always parses, arguments valid for the tool's schema),
streamed as deltas with the right indices, and a `role: tool` result continues the conversation. The reply
parsers of the three families (Hermes/Qwen, Mistral, Llama 3 JSON) on fixed texts and on constrained output."""

import json
import shutil

import jsonschema
import openai
import pytest
import torch

from serve_util import serving_model

NAME = "tiny-tools"
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
# Tools
<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>
Call one with <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m['role'] == 'assistant' and m.get('tool_calls') %}<|im_start|>assistant
{% for c in m['tool_calls'] %}<tool_call>
{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% elif m['role'] == 'tool' %}<|im_start|>user
<tool_response>
{{ m['content'] }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m['role'] }}
{{ m['content'] }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tools") / "llama"
    shutil.copytree(model_dirs["llama"][0], path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = HERMES_TEMPLATE
    tokenizer.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))  # tools are long
    with serving_model(path, NAME, kv_memory="4MiB") as (url, engine):
        yield url, engine


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0], api_key="none", timeout=60, max_retries=0)


def assert_valid_calls(calls):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_required_or_named_call_is_valid(client, choice):
    out = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=80,
                                         temperature=1.0, seed=4, n=2, parallel_tool_calls=False)
    for c in out.choices:
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        assert_valid_calls(c.message.tool_calls)
        if isinstance(choice, dict):
            assert c.message.tool_calls[0].function.name == "add"


def test_streamed_tool_call_deltas_and_round_trip(client):
    kw = dict(model=NAME, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0)
    full = client.chat.completions.create(messages=ASK, **kw).choices[0]
    assert_valid_calls(full.message.tool_calls)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(messages=ASK, stream=True, **kw):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            assert not (choice.delta.content or "").strip().startswith("<tool_call>")
            for delta in choice.delta.tool_calls or []:
                if delta.index not in calls:    # a call opens with its id and name, before any argument
                    assert delta.id and delta.type == "function" and delta.function.name
                entry = calls.setdefault(delta.index, {"name": "", "arguments": "", "pieces": 0})
                entry["name"] += (delta.function.name or "") if delta.function else ""
                entry["arguments"] += (delta.function.arguments or "") if delta.function else ""
                entry["pieces"] += bool(delta.function and delta.function.arguments)
    assert finish == "tool_calls" and sorted(calls) == list(range(len(calls)))
    assert all(c["pieces"] > 2 for c in calls.values())     # the arguments arrive as they are generated
    streamed = [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)]
    assert streamed == [(c.function.name, json.loads(c.function.arguments)) for c in full.message.tool_calls]
    # the round trip: the assistant's call and the tool's result go back; the reply is plain content
    call = full.message.tool_calls[0]
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    for stream in (False, True):
        answer = client.chat.completions.create(model=NAME, messages=messages, tools=TOOLS, tool_choice="none",
                                                max_tokens=6, temperature=0, stream=stream)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
        else:
            text = answer.choices[0].message.content
            assert answer.choices[0].finish_reason in ("stop", "length") and not answer.choices[0].message.tool_calls
            assert answer.usage.prompt_tokens > 30     # the call and the result were rendered into the prompt
        assert text


def test_auto_without_a_call_is_plain_content(client):
    out = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, max_tokens=5, temperature=0)
    assert out.choices[0].message.content and not out.choices[0].message.tool_calls


@pytest.mark.parametrize("body,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
])
def test_bad_tool_requests_are_400(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=ASK, **body)
    assert e.value.body["param"] == param


@pytest.mark.parametrize("family,text,content,calls", [
    ("hermes", 'Sure.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
               '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}</tool_call>', "Sure.",
     [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Rome", "days": 2})]),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 3, "b": 4}}]', None, [("add", {"a": 3, "b": 4})]),
    ("llama3", '<|python_tag|>{"name": "add", "parameters": {"a": 5, "b": 6}}', None, [("add", {"a": 5, "b": 6})]),
    ("hermes", "no call here <tool_call>{broken", "no call here <tool_call>{broken", []),
    ("llama3", "The answer is 4.", "The answer is 4.", []),
])
def test_parsers_of_each_family(family, text, content, calls):
    from pagedchat.serve.tools import parse_reply

    got_content, got_calls = parse_reply(text, family)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls


@pytest.mark.parametrize("family, text", [
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": "}\\"x"}}\n</tool_call>\n'
               '<tool_call>{"name":"get_weather","arguments":{"city":"Rome","days":[2]}}</tool_call>'),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 3, "b": 4}}, {"name": "x", "arguments": {}}]'),
    ("llama3", '<|python_tag|>{"name": "add", "parameters": {"a": 5, "b": 6}};{"name": "y", "parameters": {}}'),
])
def test_call_stream_sends_each_calls_name_then_its_arguments_as_they_arrive(family, text):
    """Fed one character at a time, the stream's deltas add up to exactly what the final parse says."""
    from pagedchat.serve.tools import CallStream, parse_reply

    stream, deltas = CallStream(), []
    for end in range(1, len(text) + 1):
        deltas += stream.feed(text[:end])
    _, parsed = parse_reply(text, family)
    heads = [d for d in deltas if "id" in d]
    assert [(d["index"], d["function"]["name"]) for d in heads] == list(enumerate(c.name for c in parsed))
    for i, call in enumerate(parsed):
        pieces = [d["function"]["arguments"] for d in deltas if d["index"] == i and "id" not in d]
        assert len(pieces) > 1 and json.loads("".join(pieces)) == json.loads(call.arguments)
    assert stream.rest(parsed) == ([], True)
    assert [c.id for c in parsed] == [d["id"] for d in heads]     # the final calls keep the streamed ids


def test_call_stream_leaves_what_it_cannot_read_to_the_final_parse():
    from pagedchat.serve.tools import CallStream, parse_reply

    text = '<tool_call>{"arguments": {"a": 1, "b": 2}, "name": "add"}</tool_call>'   # name last
    stream = CallStream()
    assert all(stream.feed(text[:end]) == [] for end in range(1, len(text) + 1))
    _, parsed = parse_reply(text, "hermes")
    assert stream.rest(parsed) == (parsed, True) and parsed[0].name == "add"
    one = CallStream(parallel=False)      # parallel_tool_calls false: the first call only
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    assert [d["function"]["name"] for d in one.feed(two) if "id" in d] == ["a"]


@pytest.mark.parametrize("family", ["hermes", "mistral", "llama3"])
def test_constrained_calls_of_each_family_parse(server, family):
    """The call grammar of each family, sampled at random: the output always parses back into valid calls."""
    from pagedchat.serve.tools import call_grammar, parse_reply

    engine = server[1]
    grammars = engine.grammars()
    for parallel in (False, True):
        matcher = grammars.matcher(call_grammar(TOOLS, family, parallel))
        gen, ids = torch.Generator().manual_seed(7), []
        while not matcher.is_stopped() and len(ids) < 150:
            logits = torch.randn((1, engine.loaded.spec.vocab_size), generator=gen)
            ids.append(int(grammars.mask(logits, [matcher]).argmax()))
            assert matcher.consume_token(ids[-1])
        _, calls = parse_reply(engine.tokenizer.decode(ids, skip_special_tokens=True), family)
        assert calls and all(jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name]) is None for c in calls)
