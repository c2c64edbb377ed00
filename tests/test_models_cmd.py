"""`pagedchat models list|show` and models.toml validation, through typer's CliRunner and the real entry point."""

import json

import pytest

from cli_util import invoke, read_session


@pytest.fixture
def env(xdg_home):
    return xdg_home


@pytest.fixture
def cli(typer_cli):
    return typer_cli


def test_models_list_and_show_say_where_settings_come_from(cli, model, env):
    config = env / "config" / "pagedchat"
    config.mkdir(parents=True)
    (config / "models.toml").write_text(f'[defaults.sampling]\ntemperature = 0.3\n\n[models.tiny-llama]\n'
                                        f'source = "{model}"\naliases = ["tl"]\nsystem_prompt = "be brief"\n'
                                        f'sampling = {{ top_k = 5 }}\n')
    listed = cli("models", "list", "--json")
    rows = {r["name"]: r for r in json.loads(listed.output)["models"]}
    assert rows["tiny-llama"]["aliases"] == ["tl"] and rows["tiny-llama"]["status"] == "ready"
    assert rows["demo"]["default"] is True
    shown = json.loads(cli("models", "show", "tl", "--json").output)
    settings = {s["key"]: (s["value"], s["from"]) for s in shown["settings"]}
    user_file = str(config / "models.toml")
    assert settings["sampling.top_k"] == (5, f"{user_file}:8 [models.tiny-llama]")
    assert settings["sampling.temperature"] == (0.3, f"{user_file}:2 [defaults]")
    assert settings["sampling.top_p"][1].endswith("[defaults]") and "pagedchat/models.toml" in settings[
        "sampling.top_p"][1]
    assert settings["system_prompt"] == ("be brief", f"{user_file}:7 [models.tiny-llama]")
    assert settings["sampling.min_p"] == (0.0, "built-in default")
    assert settings["max_context"] == (512, "the model's config.json")
    assert "sampling.top_k" in cli("models", "show", "tiny-llama").output
    # A chat with the registry name uses the entry's system prompt and sampling.
    run = cli("run", "-m", "tl", "--session", "r", "--max-tokens", "4", "--device", "cpu", "hi")
    assert run.exit_code == 0, run.output
    assert read_session(env, "r")["nodes"][0]["text"] == "be brief" and read_session(env, "r")["model"] == "tiny-llama"


@pytest.mark.parametrize("content, where, message", [
    ("[models.x]\nsource = \"/tmp\"\nsampling = { temperature = -1 }\n", ":3:", "temperature must be >= 0"),
    ("[models.x]\nsource = \"/tmp\"\nfoo = 1\n", ":3:", "unknown key 'foo'"),
    ("[models.x\nsource = 1\n", ":1:10:", "invalid TOML"),
    ("\n[defaults]\ndtype = \"int4\"\n", ":3:", "dtype must be one of"),
    ("[models.x]\nsource = \"/tmp\"\n\n[models.x.sampling]\ntop_p = 2.0\n", ":5:", "top_p must be in"),
    ("[models.y]\nsource = \"/tmp\"\naliases = [\"demo\"]\n", ":3:", "alias 'demo'"),
    ("[models.x]\nsource = \"/tmp\"\nmax_context = \"big\"\n", ":3:", "max_context must be an integer"),
])
def test_invalid_models_toml_is_reported_with_file_and_line(env, content, where, message, capsys, monkeypatch):
    config = env / "config" / "pagedchat"
    config.mkdir(parents=True)
    (config / "models.toml").write_text(content)
    code, out, err = invoke(["models", "list"], None, capsys, monkeypatch)
    assert code == 2 and "Traceback" not in err
    assert f"{config / 'models.toml'}{where}" in err and message in err
