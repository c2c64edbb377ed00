"""Structured output: every output of every schema parses and validates (jsonschema), greedy and sampled, with
n variants and forks; an unsupported schema is refused with one clear line."""

import json

import jsonschema
import pytest

from pagedchat.engine import Engine, EngineConfig, SamplingParams
from pagedchat.engine.core.grammar import GrammarError, GrammarSpec

NAME = {"type": "string", "maxLength": 8}
SCHEMAS = [
    {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 2}}, "required": ["s"],
     "additionalProperties": False},
    {"type": "object", "properties": {"name": NAME}, "required": ["name"], "additionalProperties": False},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
     "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": -9, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 4},
    {"enum": ["yes", "no", "maybe"]},
    {"type": "boolean"},
    {"type": "integer", "minimum": 10, "maximum": 20},
    {"type": "string", "maxLength": 5},
    {"type": "string", "pattern": "^[a-c]{2,4}$"},
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 1, "maximum": 9},
                                      "pets": {"type": "array", "items": NAME, "maxItems": 2}},
     "required": ["name", "age", "pets"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"const": "user"}, "id": {"type": "integer", "minimum": 0,
                                                                        "maximum": 999}},
     "required": ["kind", "id"], "additionalProperties": False},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                          {"type": "boolean"}]}},
     "required": ["value"], "additionalProperties": False},
    {"type": "object", "properties": {"maybe": {"type": ["string", "null"], "maxLength": 4}}, "required": ["maybe"],
     "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "items": {
        "type": "object", "properties": {"sku": {"enum": ["x1", "x2"]}, "qty": {"type": "integer", "minimum": 1,
                                                                               "maximum": 5}},
        "required": ["sku", "qty"], "additionalProperties": False}, "maxItems": 2}},
     "required": ["items"], "additionalProperties": False},
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]}, "note": NAME},
     "required": ["level"], "additionalProperties": False},
    {"$defs": {"leaf": {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 5}},
                        "required": ["v"], "additionalProperties": False}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/leaf"}, "b": {"$ref": "#/$defs/leaf"}},
     "required": ["a", "b"], "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["score"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
]


@pytest.fixture(scope="module")
def engine(model_dirs):
    return Engine(EngineConfig(model=str(model_dirs["llama"][0]), num_blocks=256), show_progress=False)


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_every_output_of_every_schema_parses_and_validates(engine):
    prompt = engine.encode("the quick brown fox")
    params = []
    for i, schema in enumerate(SCHEMAS):
        grammar = GrammarSpec.json_schema(schema)
        params.append(SamplingParams(temperature=0, max_tokens=80, grammar=grammar))
        params.append(SamplingParams(temperature=1.0, seed=i, n=2, max_tokens=80, grammar=grammar))
    outs = engine.generate([prompt] * len(params), params)   # one batch: greedy and sampled rows side by side
    assert len(SCHEMAS) >= 20
    bad = [(SCHEMAS[i // 2], v.finish_reason, v.text) for i, out in enumerate(outs) for v in out.outputs
           if v.finish_reason != "stop" or not valid(v.text, SCHEMAS[i // 2])]
    assert not bad
    engine.check_invariants()


def test_json_object_starts_an_object_and_ends_one_when_finished(engine):
    """Free-form JSON cannot force a random model to finish: whatever it wrote by max_tokens is an object's
    start, and a finished one parses as an object."""
    params = SamplingParams(temperature=1.0, seed=1, n=4, max_tokens=40, grammar=GrammarSpec.json_object())
    for variant in engine.generate([engine.encode("hello")], params)[0].outputs:
        assert variant.text.startswith("{")
        if variant.finish_reason == "stop":
            assert isinstance(json.loads(variant.text), dict)


def test_fork_continues_the_parents_grammar_state(engine):
    schema = SCHEMAS[13]
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=120, grammar=GrammarSpec.json_schema(schema))
    rid = engine.add_request(engine.encode("hello"), params)
    parent = engine.requests[rid].sequences[0]
    while parent.num_output_tokens < 3:
        engine.step()
    head = list(parent.output_ids)
    child = engine.fork(parent, params.with_(seed=6))
    while engine.has_unfinished():
        engine.step()
    parent_out, child_out = engine.pop_output(rid).outputs[0], engine.pop_output(child).outputs[0]
    assert valid(parent_out.text, schema), parent_out.text
    child_text = engine.tokenizer.decode(head + child_out.token_ids)
    assert child_out.token_ids != parent_out.token_ids[len(head):] and valid(child_text, schema), child_text


@pytest.mark.parametrize("schema", [{"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}},
                                    {"type": "strange"}])
def test_unsupported_schema_is_refused_before_queuing(engine, schema):
    with pytest.raises(GrammarError, match="unsupported json schema: ") as e:
        engine.add_request("hi", SamplingParams(grammar=GrammarSpec.json_schema(schema)))
    assert "\n" not in str(e.value)
    assert not engine.has_unfinished()


def test_run_json_schema(pagedchat_cli, model_dirs, tmp_path):
    schema = SCHEMAS[13]
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    code, out, err = pagedchat_cli("run", "-m", str(model_dirs["llama"][0]), "--json", "-n", "2", "--temperature",
                                   "1", "--max-tokens", "80", "--json-schema", str(tmp_path / "schema.json"), "hi")
    assert code == 0, err
    assert all(valid(o["text"], schema) for o in json.loads(out)["outputs"])
    (tmp_path / "broken.json").write_text("{nope")
    for path in ("broken.json", "missing.json"):
        code, out, err = pagedchat_cli("run", "-m", str(model_dirs["llama"][0]), "--json-schema",
                                       str(tmp_path / path), "hi")
        assert code != 0 and "JSON schema" in err and "Traceback" not in err


def test_schemas_with_speculation_give_the_same_tokens_and_always_validate(model_dirs):
    """n-gram drafts walk the grammar before they are verified (Grammars.mask_drafted): greedy tokens equal the
    non-speculative ones, sampled ones still validate, and drafts are really accepted (a JSON array of
    objects repeats itself, which is what n-gram drafts copy)."""
    schema = {"type": "array", "minItems": 6, "maxItems": 6, "items": {
        "type": "object", "properties": {"id": {"enum": [1, 2]}, "ok": {"type": "boolean"}},
        "required": ["id", "ok"], "additionalProperties": False}}
    picked = [SCHEMAS[0], SCHEMAS[13], schema]
    spec = Engine(EngineConfig(model=str(model_dirs["llama"][0]), num_blocks=256, speculate="ngram",
                               num_draft_tokens=6), show_progress=False)
    plain = Engine(EngineConfig(model=str(model_dirs["llama"][0]), num_blocks=256), show_progress=False)
    prompt = plain.encode("the quick brown fox")
    greedy = [SamplingParams(temperature=0, max_tokens=120, grammar=GrammarSpec.json_schema(s)) for s in picked]
    want = [o.outputs[0].token_ids for o in plain.generate([prompt] * len(greedy), greedy)]
    got = [o.outputs[0].token_ids for o in spec.generate([prompt] * len(greedy), greedy)]
    assert got == want
    assert spec.stats().spec["accepted_tokens"] > 0
    sampled = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=120, grammar=GrammarSpec.json_schema(schema))
    for variant in spec.generate([prompt], sampled)[0].outputs:
        assert variant.finish_reason == "stop" and valid(variant.text, schema), variant.text
    spec.check_invariants()
