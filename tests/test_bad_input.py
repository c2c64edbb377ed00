"""The bad-input matrix: every case gives one line on stderr, a non-zero exit code and no traceback.

Each case runs the real `pagedchat` entry point in-process (cli_util.invoke) with a tiny model built by the
test session (conftest.model_dirs), and private XDG config/data folders."""

import json
import re
import shutil

import pytest



def assert_one_line(code, err, *fragments, exit_code=2):
    assert code == exit_code, (code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("pagedchat: error: "), err
    assert "Traceback" not in err and "internal error" not in err, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


@pytest.fixture
def cli(pagedchat_cli):
    return pagedchat_cli


# -- prompt longer than the model's context ----------------------------------------------------------------------
def test_prompt_longer_than_context_names_both_numbers(cli, model):
    code, _, err = cli("run", "-m", str(model), "--raw", "word " * 600)
    assert_one_line(code, err, "model's context is 512 tokens")
    assert int(re.search(r"prompt is (\d+) tokens", err)[1]) > 512


def test_prompt_longer_than_a_capped_context_with_the_chat_template(cli, model):
    code, _, err = cli("run", "-m", str(model), "--max-context", "64", "hello world " * 30)
    assert_one_line(code, err, "model's context is 64 tokens")
    assert int(re.search(r"prompt is (\d+) tokens", err)[1]) > 64


def test_prompt_longer_than_context_in_a_session_turn(cli, model):
    code, _, err = cli("run", "-m", str(model), "--max-context", "64", "--session", "s1", "hello world " * 30)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "64" in err and re.search(r"\b(\d{3})\b tokens", err), err
    # Shell advice, not the REPL's slash commands.
    assert "new session" in err and "pagedchat chat --session s1" in err and "/clear" not in err, err


def test_prompt_larger_than_the_whole_pool(cli, model):
    # one 16-token block of this model is 8 KiB: 32 KiB holds 64 tokens
    code, _, err = cli("run", "-m", str(model), "--raw", "--kv-memory", "32KiB", "word " * 100)
    assert_one_line(code, err, "whole KV pool holds 64 tokens", "raise --kv-memory")


def test_reply_outgrowing_the_pool_fails_with_exit_1(cli, model):
    code, out, err = cli("run", "-m", str(model), "--raw", "--json", "--temperature", "0", "--kv-memory", "32KiB",
                         "--max-tokens", "200", "hello world")
    assert_one_line(code, err, "more KV memory than the whole pool", exit_code=1)
    assert json.loads(out)["outputs"][0]["finish_reason"] == "error"


def test_batch_prompt_too_big_fails_alone_others_complete(cli, model, tmp_path):
    batch = tmp_path / "batch.jsonl"
    prompts = ["hello world", "the lazy dog " * 60, "a b c d", "word " * 600]
    batch.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    code, out, err = cli("run", "-m", str(model), "--raw", "--json", "--temperature", "0", "--max-tokens", "4",
                         "--kv-memory", "64KiB", "--file", str(batch))
    assert code == 1 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("pagedchat: error: prompt 2: ") and "whole KV pool" in lines[0]
    assert lines[1].startswith("pagedchat: error: prompt 4: ") and "context is 512" in lines[1]
    results = json.loads(out)["results"]
    reasons = [r["outputs"][0]["finish_reason"] for r in results]
    assert reasons == ["length", "error", "length", "error"]
    assert len(results[0]["outputs"][0]["token_ids"]) == 4


# -- which model ---------------------------------------------------------------------------------------------------
def write_user_toml(tmp_path, text: str):
    path = tmp_path / "config" / "pagedchat" / "models.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_unknown_model_lists_close_matches(cli, model, tmp_path):
    write_user_toml(tmp_path, f'[models.llama-tiny]\nsource = "{model}"\n\n[models.qwen-tiny]\nsource = "{model}"\n')
    code, _, err = cli("run", "-m", "llama-tiy", "hi")
    assert_one_line(code, err, "unknown model 'llama-tiy'", "did you mean", "llama-tiny")
    code, _, err = cli("run", "-m", "zzz", "hi")
    assert_one_line(code, err, "unknown model 'zzz'", "known models:", "llama-tiny", "qwen-tiny")


def test_missing_folder_path(cli, tmp_path):
    code, _, err = cli("run", "-m", str(tmp_path / "nowhere"), "hi")
    assert_one_line(code, err, "not found")


# -- a model folder with missing or corrupt files --------------------------------------------------------------
def _edit_json(name, change):
    def edit(folder):
        data = json.loads((folder / name).read_text())
        change(data)
        (folder / name).write_text(json.dumps(data))
    return edit


def _truncate(fraction):
    def edit(folder):
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[:int(len(data) * fraction)])
    return edit


def _split_index(folder):
    """A sharded checkpoint whose index names a shard that is not there."""
    weights = folder / "model.safetensors"
    weights.rename(folder / "model-00001-of-00002.safetensors")
    from safetensors import safe_open

    with safe_open(str(folder / "model-00001-of-00002.safetensors"), "pt") as f:
        keys = list(f.keys())
    weight_map = {k: "model-00001-of-00002.safetensors" for k in keys}
    weight_map[keys[-1]] = "model-00002-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


CORRUPTIONS = {
    "config.json missing": (lambda f: (f / "config.json").unlink(), "has no config.json"),
    "config.json not JSON": (lambda f: (f / "config.json").write_text('{"hidden_size": 64,'), "config.json"),
    "config.json a list": (lambda f: (f / "config.json").write_text("[1, 2]"), "config.json"),
    "tokenizer.json corrupt": (lambda f: (f / "tokenizer.json").write_text("{not json"), "tokenizer"),
    "tokenizer_config.json corrupt": (lambda f: (f / "tokenizer_config.json").write_text("{bad"), "tokenizer"),
    "generation_config.json corrupt": (lambda f: (f / "generation_config.json").write_text("{bad"),
                                       "generation_config.json is not valid JSON"),
    "weights missing": (lambda f: (f / "model.safetensors").unlink(), "missing model.safetensors"),
    "only .bin weights": (lambda f: (f / "model.safetensors").rename(f / "pytorch_model.bin"), "safetensors only"),
    "shard listed in the index missing": (_split_index, "missing weight shards: model-00002-of-00002.safetensors"),
    "index not JSON": (lambda f: (f / "model.safetensors.index.json").write_text("{"), "is corrupt"),
    "safetensors truncated (data)": (_truncate(0.9), "corrupt or truncated"),
    "safetensors truncated (header)": (_truncate(0.001), "corrupt or truncated"),
    "safetensors garbage": (lambda f: (f / "model.safetensors").write_bytes(b"\x00garbage" * 10), "corrupt"),
    "config has more layers than the weights": (_edit_json("config.json", lambda c: c.update(num_hidden_layers=3)),
                                                "checkpoint is missing tensors"),
    "config shapes differ from the weights": (_edit_json("config.json", lambda c: c.update(intermediate_size=96)),
                                              "config expects"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_model_folder_with_missing_or_corrupt_files(cli, model, tmp_path, case):
    folder = tmp_path / "model"
    shutil.copytree(model, folder)
    damage, message = CORRUPTIONS[case]
    damage(folder)
    code, _, err = cli("run", "-m", str(folder), "--max-tokens", "2", "hi")
    assert_one_line(code, err, message)


def test_model_path_is_a_file(cli, model):
    code, _, err = cli("run", "-m", str(model / "config.json"), "hi")
    assert_one_line(code, err, "neither an HF model folder nor a GGUF file")


@pytest.mark.parametrize("arch,model_type", [("GPT2LMHeadModel", "gpt2"), ("Qwen2MoeForCausalLM", "qwen2_moe"),
                                             (None, "llama")])
def test_unsupported_architecture(cli, model, tmp_path, arch, model_type):
    folder = tmp_path / "model"
    shutil.copytree(model, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type=model_type, architectures=[arch] if arch else None)
    (folder / "config.json").write_text(json.dumps(config))
    code, _, err = cli("run", "-m", str(folder), "hi")
    assert_one_line(code, err, f"unsupported architecture {arch!r}", "LlamaForCausalLM", "Qwen3ForCausalLM",
                    "Phi3ForCausalLM", "MixtralForCausalLM", "Gemma3ForCausalLM")


@pytest.mark.parametrize("template,message", [
    ("{% for m in messages %}{{ m.content ", "unexpected end of template"),
    ('{{ raise_exception("roles must alternate") }}', "roles must alternate"),
    ("{{ messages[5].content }}", "no element 5"),
])
@pytest.mark.parametrize("session", [False, True])
def test_broken_chat_template(cli, model, tmp_path, template, message, session):
    folder = tmp_path / "model"
    shutil.copytree(model, folder)
    (folder / "chat_template.jinja").write_text(template)
    code, _, err = cli("run", "-m", str(folder), *(["--session", "t"] if session else []), "--max-tokens", "2", "hi")
    assert_one_line(code, err, "chat template", message)
    code, out, err = cli("run", "-m", str(folder), "--raw", "--max-tokens", "2", "hi")   # --raw still works
    assert code == 0, err


def test_unknown_model_type(cli, model, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(model, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="no-such-type")
    (folder / "config.json").write_text(json.dumps(config))
    code, _, err = cli("run", "-m", str(folder), "hi")
    assert_one_line(code, err, "config.json")


# -- models.toml, bundled or the user's copy -----------------------------------------------------------------------
TOML_CASES = {
    # name: (file text, line, what is wrong)
    "syntax": ('[defaults]\nmodel = "x"\n\n[models.x\nsource = "/m"\n', "4:", "invalid TOML"),
    "unknown key": ('[models.x]\nsource = "/m"\ndescription = "ok"\nsourse = "/m"\n', "4:", "unknown key 'sourse'"),
    "wrong type": ('[models.x]\nsource = "/m"\n\nmax_context = "big"\n', "4:", "max_context must be an integer"),
    "bad sampling value": ('[models.x]\nsource = "/m"\nsampling = { temperature = -1 }\n', "3:",
                           "temperature must be >= 0"),
    "bad sampling type": ('[defaults]\n\n[defaults.sampling]\ntop_p = "high"\n', "4:", "top_p must be a number"),
    "unknown sampling key": ('[models.x]\nsource = "/m"\n[models.x.sampling]\ntemprature = 1\n', "4:",
                             "unknown key 'temprature'"),
    "bad dtype": ('# my models\n[models.x]\nsource = "/m"\ndtype = "float8"\n', "4:", "dtype must be one of"),
    "unknown table": ('[model.x]\nsource = "/m"\n', "1:", "unknown top-level table [model]"),
    "trust_remote_code not a bool": ('[models.x]\nsource = "/m"\ntrust_remote_code = "yes"\n', "3:",
                                     "trust_remote_code must be true or false"),
}


@pytest.mark.parametrize("case", list(TOML_CASES))
@pytest.mark.parametrize("copy", ["user", "bundled"])
def test_invalid_models_toml_names_file_line_and_problem(cli, model, tmp_path, monkeypatch, copy, case):
    text, line, problem = TOML_CASES[case]
    if copy == "user":
        path = write_user_toml(tmp_path, text)
    else:
        path = tmp_path / "bundled" / "models.toml"
        path.parent.mkdir()
        path.write_text(text)
        monkeypatch.setattr("pagedchat.registry.bundled_config_path", lambda: path)
    code, _, err = cli("run", "-m", str(model), "hi")
    assert_one_line(code, err, f"{path}:{line}", problem)


@pytest.mark.parametrize("copy", ["user", "bundled"])
def test_models_toml_that_is_not_utf8(cli, model, tmp_path, monkeypatch, copy):
    path = write_user_toml(tmp_path, "") if copy == "user" else tmp_path / "models.toml"
    path.write_bytes(b'[models.x]\n\ndescription = "caf\xe9"\n')
    if copy == "bundled":
        monkeypatch.setattr("pagedchat.registry.bundled_config_path", lambda: path)
    code, _, err = cli("run", "-m", str(model), "hi")
    assert_one_line(code, err, f"{path}:3: ", "not UTF-8")


# -- text that is not UTF-8 -----------------------------------------------------------------------------------------
def test_prompt_bytes_that_are_not_utf8(cli, model, tmp_path):
    # undecodable bytes reach Python as lone surrogates (surrogateescape, on argv and a non-UTF-8 stdin)
    code, _, err = cli("run", "-m", str(model), "--raw", "caf\udce9")
    assert_one_line(code, err, "the prompt argument is not valid UTF-8")
    code, _, err = cli("run", "-m", str(model), "--session", "s", stdin="caf\udce9 au lait\n")
    assert_one_line(code, err, "the prompt on stdin is not valid UTF-8")
    batch = tmp_path / "batch.jsonl"
    batch.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    code, _, err = cli("run", "-m", str(model), "--file", str(batch))
    assert_one_line(code, err, f"{batch}:2: not valid UTF-8")


# -- sampling values -----------------------------------------------------------------------------------------------
BAD_FLAGS = [
    (["--temperature", "-0.5"], "temperature must be >= 0"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--max-tokens", "0"], "max_tokens must be >= 1"),
    (["--max-tokens", "-3"], "max_tokens must be >= 1"),
    (["--top-k", "-2"], "top_k must be >= 0"),
    (["--min-p", "1"], "min_p must be in [0, 1)"),
    (["--repetition-penalty", "0"], "repetition_penalty must be > 0"),
    (["--temperature", "inf"], "temperature must be finite"),
    (["--temperature", "nan"], "temperature must be >= 0"),
    (["-n", "0"], "-n must be >= 1"),
    (["-n", "100000"], "100000 variants is more than the 256 sequences"),
    (["--seed", str(2**70)], "seed must fit in 64 bits"),
    (["--max-context", "0"], "--max-context must be a positive number"),
    (["--block-size", "12"], "--block-size must be a power of two"),
    (["--kv-memory", "lots"], "invalid size 'lots'"),
    (["--kv-memory", "0"], "must be positive"),
    (["--kv-memory", "150%"], "a percentage must be in (0%, 100%]"),
    (["--device", "tpu"], "unknown device 'tpu'"),
    (["--dtype", "int3"], "unknown dtype 'int3'"),
]


@pytest.mark.parametrize("command", ["run", "chat"])
@pytest.mark.parametrize("args,message", BAD_FLAGS[:10])
def test_invalid_sampling_flags(cli, model, command, args, message):
    code, _, err = cli(command, "-m", str(model), *args, *(["hi"] if command == "run" else []))
    assert_one_line(code, err, message)


@pytest.mark.parametrize("args,message", BAD_FLAGS[10:])
def test_invalid_model_and_pool_flags(cli, model, args, message):
    code, _, err = cli("run", "-m", str(model), *args, "hi")
    assert_one_line(code, err, message)


@pytest.mark.parametrize("args", [["--repetition-penalty", "1.3"], ["--repetition-penalty", "0.01"],
                                  ["--temperature", "1e-30"], ["--temperature", "1e30"], ["--top-p", "1e-30"],
                                  ["--min-p", "0.999999"], ["--top-k", "99999999"], ["--seed", "-1"]])
def test_extreme_but_valid_sampling_values_work(cli, model, args):
    code, out, err = cli("run", "-m", str(model), "--raw", "--json", "--temperature", "1", "--seed", "3",
                         "--max-tokens", "6", *args, "hello world")
    assert code == 0 and not err.strip(), err
    assert len(json.loads(out)["outputs"][0]["token_ids"]) == 6


def test_repetition_penalty_really_applies(cli, model):
    """A huge penalty on greedy decoding: no token is ever repeated (the flag used to crash on real logits)."""
    args = ["run", "-m", str(model), "--raw", "--json", "--temperature", "0", "--max-tokens", "30"]
    code, out, err = cli(*args, "--repetition-penalty", "1000", "hello world hello world")
    assert code == 0, err
    tokens = json.loads(out)["outputs"][0]["token_ids"]
    assert len(set(tokens)) == len(tokens) == 30
    code, out, _ = cli(*args, "hello world hello world")
    plain = json.loads(out)["outputs"][0]["token_ids"]
    assert len(set(plain)) < len(plain)                      # without it, greedy decoding repeats itself


@pytest.mark.parametrize("line,message", [
    ({"prompt": "hi", "temperature": -1}, "temperature must be >= 0"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature must be a number, got 'hot'"),
    ({"prompt": "hi", "top_p": 0}, "top_p must be in (0, 1]"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens must be >= 1"),
    ({"prompt": "hi", "max_tokens": 2.5}, "max_tokens must be an integer"),
    ({"prompt": "hi", "n": "x"}, "n must be an integer"),
    ({"prompt": "hi", "n": 0}, "n (variants) must be >= 1"),
    ({"prompt": "hi", "stop": 5}, "stop must be a string or a list of strings"),
    ({"prompt": "hi", "system": 5}, '"system" must be a string'),
    ({"prompt": 5}, 'string "prompt"'),
    ("{not json", "not valid JSON"),
])
def test_invalid_batch_lines_name_the_line(cli, model, tmp_path, line, message):
    batch = tmp_path / "batch.jsonl"
    text = line if isinstance(line, str) else json.dumps(line)
    batch.write_text(json.dumps({"prompt": "fine"}) + "\n\n" + text + "\n")
    code, _, err = cli("run", "-m", str(model), "--file", str(batch))
    assert_one_line(code, err, f"{batch}:3: ", message)


@pytest.mark.parametrize("command,message", [
    ("/set tempreature 0.5", "unknown setting 'tempreature'"),
    ("/set temperature -1", "temperature must be >= 0"),
    ("/set temperature hot", "temperature must be a number"),
    ("/set top_p 0", "top_p must be in (0, 1]"),
    ("/set top_p 1.01", "top_p must be in (0, 1]"),
    ("/set max_tokens 0", "max_tokens must be >= 1"),
    ("/set max_tokens 2.5", "max_tokens must be an integer"),
    ("/fork 0", "usage: /fork N"),
    ("/fork 99", "usage: /fork N"),
    ("/switch 999", "no node #999"),
    ("/nosuchcommand", "unknown command /nosuchcommand"),
])
def test_invalid_repl_commands_are_one_red_line(model_dirs, tmp_path, command, message):
    from rich.console import Console

    from pagedchat.chat.controller import ChatController
    from pagedchat.chat.shell import ChatShell, ChatUI
    from pagedchat.chat.store import SessionStore
    from pagedchat.settings import ModelOptions, SamplingOptions, load_engine

    engine, entry = load_engine(ModelOptions(str(model_dirs["llama"][0]), device="cpu", kv_memory="1MiB"),
                                show_progress=False)
    ctl = ChatController(engine, entry, SessionStore(tmp_path / "sessions"), SamplingOptions(max_tokens=3))
    ctl.new_session("s")
    console = Console(file=__import__("io").StringIO(), width=200, color_system=None)
    shell = ChatShell(ctl, ChatUI(console))
    before = dict(ctl.session.settings)
    shell.handle(command)
    shown = console.file.getvalue()
    assert message in shown and "Traceback" not in shown, shown
    assert len(shown.strip().splitlines()) == 1, shown
    assert ctl.session.settings == before
    shell.handle("hello")                                   # the REPL is still usable
    assert len(ctl.session.tree) == 2
    engine.check_invariants()
