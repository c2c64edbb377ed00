"""`pagedchat run --json` reports "prompt_token_ids": the ids the model saw, after the chat template (or the
raw encoding with --raw); per result with --file; one list for the -n variants of one prompt. On the shipped
demo model, the default one."""

from __future__ import annotations

import importlib.resources
import json

import pytest

DEMO = importlib.resources.files("pagedchat") / "assets" / "demo-chat"
FAST = ["--device", "cpu", "--kv-memory", "4MiB", "--threads", "1", "--max-tokens", "4", "--json"]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEMO))


def chat_ids(tokenizer, user: str, system: str | None = None) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def run_json(pagedchat_cli, *args) -> dict:
    code, out, err = pagedchat_cli("run", *FAST, *args)
    assert code == 0, err
    return json.loads(out)


def test_the_chat_templates_ids(pagedchat_cli, tokenizer):
    report = run_json(pagedchat_cli, "what is 2 + 3?")
    ids = report["prompt_token_ids"]
    assert ids == chat_ids(tokenizer, "what is 2 + 3?")
    assert all(type(t) is int for t in ids)
    assert report["usage"]["prompt_tokens"] == len(ids)


def test_with_a_system_prompt(pagedchat_cli, tokenizer):
    report = run_json(pagedchat_cli, "--system", "You answer briefly.", "name a colour")
    assert report["prompt_token_ids"] == chat_ids(tokenizer, "name a colour", "You answer briefly.")
    assert report["prompt_token_ids"] != chat_ids(tokenizer, "name a colour")


def test_raw_is_the_tokenizers_encoding(pagedchat_cli, tokenizer):
    report = run_json(pagedchat_cli, "--raw", "the quick brown fox")
    assert report["prompt_token_ids"] == tokenizer("the quick brown fox").input_ids


def test_variants_share_one_prompt(pagedchat_cli, tokenizer):
    report = run_json(pagedchat_cli, "-n", "3", "--temperature", "1", "--seed", "1", "tell me a word")
    assert len(report["outputs"]) == 3
    assert report["prompt_token_ids"] == chat_ids(tokenizer, "tell me a word")


def test_a_batch_has_each_prompts_ids(pagedchat_cli, tokenizer, tmp_path):
    jobs = [{"prompt": "hello"}, {"prompt": "what is 4 + 4?", "system": "Be exact."}, {"prompt": "bye", "n": 2}]
    batch = tmp_path / "prompts.jsonl"
    batch.write_text("".join(json.dumps(job) + "\n" for job in jobs))
    report = run_json(pagedchat_cli, "--file", str(batch))
    assert "prompt_token_ids" not in report       # per result, not for the whole run
    assert [r["prompt_token_ids"] for r in report["results"]] == \
        [chat_ids(tokenizer, job["prompt"], job.get("system")) for job in jobs]
    for result in report["results"]:
        assert result["usage"]["prompt_tokens"] == len(result["prompt_token_ids"])


def test_a_session_turn_reports_the_whole_path_it_saw(pagedchat_cli, tokenizer):
    """With --session the second turn's prompt is the first exchange's exact tokens plus the new message."""
    first = run_json(pagedchat_cli, "--session", "ids", "--temperature", "0", "what is 2 + 3?")
    second = run_json(pagedchat_cli, "--session", "ids", "--temperature", "0", "and 4 + 5?")
    history = first["prompt_token_ids"] + first["outputs"][0]["token_ids"]
    assert first["prompt_token_ids"] == chat_ids(tokenizer, "what is 2 + 3?")
    assert second["prompt_token_ids"][:len(history)] == history
    assert second["usage"]["prompt_tokens"] == len(second["prompt_token_ids"])
