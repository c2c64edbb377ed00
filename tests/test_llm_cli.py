"""The `llm` CLI (simonw/llm) against `pagedchat serve`, configured as its docs say for OpenAI-compatible
servers (extra-openai-models.yaml): a chat prompt, and `llm --schema` whose output validates."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from serve_util import serving_model

LLM = shutil.which("llm") or str(Path(sys.executable).with_name("llm"))
pytestmark = pytest.mark.skipif(not Path(LLM).exists(), reason="the llm CLI is not installed")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(model_dirs, tmp_path_factory):
    home = tmp_path_factory.mktemp("llm")
    with serving_model(model_dirs["llama"][0], "tiny") as (url, _):
        (home / "extra-openai-models.yaml").write_text(
            f"- model_id: tiny\n  model_name: tiny\n  api_base: \"{url}\"\n  supports_schema: true\n")
        env = {**os.environ, "LLM_USER_PATH": str(home), "OPENAI_API_KEY": "unused"}

        def run(*args: str) -> str:
            done = subprocess.run([LLM, *args], env=env, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr
            return done.stdout

        yield run


def test_llm_chat_prompt(llm):
    assert llm("-m", "tiny", "-o", "max_tokens", "6", "-o", "temperature", "0", "hello world").strip()


def test_llm_schema(llm, tmp_path):
    out = llm("-m", "tiny", "--schema", json.dumps(SCHEMA), "-o", "max_tokens", "60", "a person")
    jsonschema.validate(json.loads(out), SCHEMA)
