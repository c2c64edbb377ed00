"""`pagedchat run`: the DESIGN.md contract, checked against transformers, and its user errors."""

import json

import pytest

from oracle import assert_greedy_equal, reference


@pytest.fixture
def run(pagedchat_cli):
    return pagedchat_cli


def test_raw_greedy_json_matches_transformers(run, model_dirs):
    path, hf = model_dirs["qwen3"]
    code, out, err = run("run", "-m", str(path), "--raw", "--temperature", "0", "--json", "--max-tokens", "16",
                         "the quick brown fox")
    assert code == 0, err
    report = json.loads(out)
    assert set(report) >= {"model", "outputs", "usage", "kv", "timing"}
    assert set(report["kv"]) == {"block_size", "num_blocks", "peak_blocks_used", "prefix_hit_tokens",
                                 "ram_hit_tokens", "disk_hit_tokens", "kv_dtype"}
    assert report["kv"]["kv_dtype"] == "float32"
    assert set(report["timing"]) == {"ttft_s", "decode_tokens_per_s", "total_s"}
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(path)("the quick brown fox").input_ids
    ref_tokens, ref_logits = reference(hf, ids, 16)
    assert_greedy_equal(report["outputs"][0]["token_ids"], ref_tokens, ref_logits)
    assert report["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(report["outputs"][0]["token_ids"])}


def test_file_batch_results_in_input_order(run, model_dirs, tmp_path):
    path, hf = model_dirs["llama"]
    prompts = ["hello world", "a b c d e f g", "what is 17 + 25?", "the lazy dog " * 6]
    batch = tmp_path / "prompts.jsonl"
    batch.write_text("\n".join(json.dumps({"prompt": p}) for p in prompts) + "\n")
    code, out, err = run("run", "-m", str(path), "--raw", "--temperature", "0", "--json", "--max-tokens", "12",
                         "--file", str(batch))
    assert code == 0, err
    report = json.loads(out)
    assert len(report["results"]) == len(prompts)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    for prompt, result in zip(prompts, report["results"]):
        ref_tokens, ref_logits = reference(hf, tok(prompt).input_ids, 12)
        assert_greedy_equal(result["outputs"][0]["token_ids"], ref_tokens, ref_logits)


def test_variants_share_the_prompt(run, model_dirs):
    path, _ = model_dirs["mistral"]
    long_prompt = "paged attention keeps every branch in one pool " * 20
    code, out, err = run("run", "-m", str(path), "--raw", "--json", "-n", "8", "--temperature", "1", "--seed", "3",
                         "--max-tokens", "8", "--block-size", "16", long_prompt)
    assert code == 0, err
    report = json.loads(out)
    assert len(report["outputs"]) == 8
    prompt_blocks = -(-report["usage"]["prompt_tokens"] // 16)
    assert report["kv"]["peak_blocks_used"] <= prompt_blocks + 8 * 2  # one prompt + each child's own tail


def test_stdin_and_chat_template_stream(run, model_dirs):
    path, _ = model_dirs["llama"]
    code, out, err = run("run", "-m", str(path), "--max-tokens", "5", "--temperature", "0", stdin="hello world\n")
    assert code == 0, err
    assert out.endswith("\n")


def test_stop_string_cuts_text(run, model_dirs):
    path, _ = model_dirs["llama"]
    code, out, _ = run("run", "-m", str(path), "--raw", "--json", "--temperature", "0", "--max-tokens", "30",
                       "hello world")
    text = json.loads(out)["outputs"][0]["text"]
    stop = text[5:7] if len(text) > 7 else None
    if not stop or not stop.strip():
        pytest.skip("greedy text of the random model too short for a stop string")
    code, out, _ = run("run", "-m", str(path), "--raw", "--json", "--temperature", "0", "--max-tokens", "30",
                       "--stop", stop, "hello world")
    result = json.loads(out)["outputs"][0]
    assert result["finish_reason"] == "stop" and result["text"] == text[:text.index(stop)]


@pytest.mark.parametrize("args,message", [
    (["-m", "no-such-model"], "unknown model 'no-such-model'"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--max-tokens", "0"], "max_tokens must be >= 1"),
    (["--kv-memory", "lots"], "invalid size 'lots'"),
    (["--block-size", "12"], "--block-size must be a power of two"),
])
def test_user_errors_are_one_line(run, model_dirs, args, message):
    path, _ = model_dirs["llama"]
    full = ["run", "-m", str(path), *args, "hi"] if args[0] != "-m" else ["run", *args, "hi"]
    code, out, err = run(*full)
    assert code == 2
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_prompt_longer_than_context(run, model_dirs):
    path, _ = model_dirs["llama"]
    code, _, err = run("run", "-m", str(path), "--raw", "word " * 600)
    assert code == 2 and "model's context is 512 tokens" in err and "Traceback" not in err


def test_missing_weights_and_unsupported_architecture(run, model_dirs, tmp_path):
    import shutil

    path, _ = model_dirs["llama"]
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    (broken / "model.safetensors").unlink()
    code, _, err = run("run", "-m", str(broken), "hi")
    assert code == 2 and "missing model.safetensors" in err
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    shutil.copy(path / "model.safetensors", broken / "model.safetensors")
    (broken / "config.json").write_text(json.dumps(config))
    code, _, err = run("run", "-m", str(broken), "hi")
    assert code == 2 and "unsupported architecture 'GPT2LMHeadModel'" in err and "LlamaForCausalLM" in err
    (broken / "model.safetensors").write_bytes(b"\x00garbage")
    (broken / "config.json").write_text((path / "config.json").read_text())
    code, _, err = run("run", "-m", str(broken), "hi")
    assert code == 2 and "corrupt" in err and "Traceback" not in err


def test_raw_beams_json_matches_transformers(run, model_dirs):
    """The outside check's command: every hypothesis, best first, with its score, as transformers' beam search."""
    from beam_oracle import beam_reference

    path, hf = model_dirs["mistral"]
    code, out, err = run("run", "-m", str(path), "--raw", "--beams", "4", "--length-penalty", "0.5",
                         "--early-stopping", "never", "--json", "--max-tokens", "10", "hello world")
    assert code == 0, err
    report = json.loads(out)
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(path)("hello world").input_ids
    expected = beam_reference(hf, ids, 4, 10, 0.5, "never")
    assert [o["token_ids"] for o in report["outputs"]] == [tokens for tokens, _ in expected]
    for output, (_, score) in zip(report["outputs"], expected):
        assert output["score"] == pytest.approx(score, rel=1e-4)
    assert report["usage"]["completion_tokens"] == sum(len(o["token_ids"]) for o in report["outputs"])


@pytest.mark.parametrize("args, message", [(["--beams", "2", "-n", "2"], "leave out -n"),
                                           (["--beams", "2", "--early-stopping", "maybe"], "true, false or never"),
                                           (["--beams", "-1"], "--beams must be")])
def test_bad_beam_options_are_one_line_errors(run, model_dirs, args, message):
    code, out, err = run("run", "-m", str(model_dirs["llama"][0]), "--raw", *args, "hi")
    assert code != 0 and message in err and "Traceback" not in err
