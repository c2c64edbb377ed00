"""scripts/e2e_tmux_chat.sh: the real `pagedchat chat` in a tmux terminal (chat, /fork 3, /tree, /switch,
/regen, /stats, Ctrl-C, /exit; no traceback on screen; every variant saved; second turn served from cache), on a
tiny random model and on a real GGUF model (SmolLM2-135M-Instruct), whose session is also reopened and continued."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "e2e_tmux_chat.sh"


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_chat_end_to_end_in_tmux(tmp_path):
    env = {**os.environ, "PAGEDCHAT": f"{sys.executable} -m pagedchat.cli", "PYTHON": sys.executable,
           "TERM": "xterm-256color", "E2E_TIMEOUT": "120"}
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "work")], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "PASS" in done.stdout


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_chat_with_a_real_gguf_model_in_tmux(tmp_path):
    from real_files import real_file

    model = real_file("smollm2")
    env = {**os.environ, "PAGEDCHAT": f"{sys.executable} -m pagedchat.cli", "PYTHON": sys.executable,
           "TERM": "xterm-256color", "E2E_TIMEOUT": "180", "E2E_MODEL": str(model), "E2E_ARGS": "--quantize none"}
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "work")], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "PASS" in done.stdout and "reopened" in done.stdout
