#!/usr/bin/env bash
# End-to-end check of the real `pagedchat chat` REPL in a tmux terminal, against a tiny random ChatML model
# built with tests/hf_models.py. It types like a user and reads the screen:
#   two chat turns (the second turn's stats line must show the history served from cache), /fork 3, /tree,
#   /switch, /regen, /stats, Ctrl-C during a reply, /exit;
# then checks that no traceback ever reached the screen and that the saved session file holds every variant.
#
# With E2E_MODEL (a model reference: a GGUF file, say) the same steps run on that model instead (E2E_ARGS: more
# flags for `chat`), and the session is reopened in a second REPL and continued.
#
# Usage: scripts/e2e_tmux_chat.sh [WORKDIR]     (needs tmux; env PAGEDCHAT overrides the command to run)
# Exit status 0 = pass. The screen is kept in WORKDIR/screen.txt.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${1:-$(mktemp -d -t pagedchat-e2e.XXXXXX)}"
PAGEDCHAT="${PAGEDCHAT:-pagedchat}"
PYTHON="${PYTHON:-python}"
SOCKET="pagedchat-e2e-$$"          # a private tmux server: never touches the user's sessions
TIMEOUT="${E2E_TIMEOUT:-90}"
mkdir -p "$WORK"

command -v tmux >/dev/null || { echo "SKIP: tmux is not installed"; exit 77; }

tmx() { tmux -L "$SOCKET" "$@"; }
cleanup() { tmx kill-server 2>/dev/null || true; }
trap cleanup EXIT

fail() {
    echo "FAIL: $*"
    screen > "$WORK/screen.txt" 2>/dev/null || true
    echo "--- screen (last 40 lines; all of it in $WORK/screen.txt) ---"
    tail -n 40 "$WORK/screen.txt" || true
    exit 1
}
pass() { echo "ok: $*"; }

screen() { tmx capture-pane -p -J -t e2e -S -5000; }

# wait_for REGEX [COUNT]: until the screen holds COUNT lines matching REGEX (default 1)
wait_for() {
    local regex="$1" count="${2:-1}" deadline=$((SECONDS + TIMEOUT))
    while (( SECONDS < deadline )); do
        if (( $(screen | grep -cE -- "$regex" || true) >= count )); then return 0; fi
        sleep 0.2
    done
    fail "timed out waiting for /$regex/ x$count"
}

type_line() { tmx send-keys -t e2e -l -- "$1"; tmx send-keys -t e2e Enter; }
STATS='prompt [0-9]+ new \+ [0-9]+ cached'

# -- a model and a private XDG home -----------------------------------------------------------------------
MODEL="${E2E_MODEL:-$WORK/model}"
if [[ -z "${E2E_MODEL:-}" ]]; then
"$PYTHON" - "$REPO/tests" "$WORK/model" <<'EOF' >/dev/null 2>&1
import sys
sys.path.insert(0, sys.argv[1])
from hf_models import build_model
model = build_model("llama", sys.argv[2], max_position_embeddings=8192)
# EOS's logit pinned at 0 among peaked random logits: replies never end by themselves, so the Ctrl-C step
# always finds one running (and 8192 positions leave room for a long one).
import torch
with torch.no_grad():
    model.lm_head.weight[model.config.eos_token_id].zero_()
model.save_pretrained(sys.argv[2])
EOF
pass "built a tiny llama model in $WORK/model"
fi
export XDG_DATA_HOME="$WORK/data" XDG_CONFIG_HOME="$WORK/config"
SESSION_FILE="$XDG_DATA_HOME/pagedchat/sessions/e2e.json"

# -- start the REPL ------------------------------------------------------------------------------------------
# start_repl: `pagedchat chat` on session e2e in the tmux window, until its prompt shows
start_repl() {
    tmx new-session -d -s e2e -x 140 -y 50 \
        "cd '$WORK' && XDG_DATA_HOME='$XDG_DATA_HOME' XDG_CONFIG_HOME='$XDG_CONFIG_HOME' $PAGEDCHAT chat \
         -m '$MODEL' --session e2e --device cpu --kv-memory 16MiB --temperature 0 ${E2E_ARGS:-}; \
         echo \"PAGEDCHAT-EXIT=\$?\"; sleep 600"
    wait_for '^>>>'
}
start_repl
pass "REPL started"

# -- two turns: the second prefills only the new message ------------------------------------------------------
type_line "/set max_tokens 24"
wait_for 'max_tokens = 24'
type_line "hello world"
wait_for "$STATS" 1
type_line "what is 17 + 25?"
wait_for "$STATS" 2
second="$(screen | grep -E -- "$STATS" | sed -n 2p)"
cached="$(sed -E 's/.*prompt [0-9]+ new \+ ([0-9]+) cached.*/\1/' <<<"$second")"
(( cached > 0 )) || fail "second turn served nothing from cache: $second"
pass "second turn: $cached history tokens served from cache ($second)"

# -- /fork 3: three variants side by side ---------------------------------------------------------------------
type_line "/fork 3"
wait_for "$STATS" 3
for k in 1 2 3; do screen | grep -q "variant $k · #" || fail "variant $k not shown"; done
pass "/fork 3 streamed three variants"

type_line "/tree"
wait_for 'v3 “'
screen | grep -q '◀ head' || fail "/tree does not mark the head"
pass "/tree shows the variants and the head"

type_line "/switch 2"
wait_for 'head is now #2'
type_line "/regen"
wait_for "$STATS" 4
pass "/switch and /regen"

type_line "/stats"
wait_for 'prefix cache +[0-9.]+% hit rate'
pass "/stats"

# -- Ctrl-C during a long reply ------------------------------------------------------------------------------
type_line "/set max_tokens 3000"
wait_for 'max_tokens = 3000'
type_line "/clear"
wait_for 'new conversation'
type_line "tell me a long story"
sleep 0.3   # a few hundred tokens into a reply of thousands
tmx send-keys -t e2e C-c
wait_for 'interrupted: the partial reply is kept as #'
wait_for "$STATS" 5

pass "Ctrl-C stopped the reply and kept it"

type_line "/exit"
wait_for 'PAGEDCHAT-EXIT=0'
pass "/exit"

# -- the session reopened in a new REPL, continued ------------------------------------------------------------
if [[ -n "${E2E_MODEL:-}" ]]; then
    tmx kill-session -t e2e
    start_repl
    type_line "/tree"
    wait_for 'v3 “'
    type_line "/set max_tokens 16"
    wait_for 'max_tokens = 16'
    type_line "and one more thing?"
    wait_for "$STATS" 1
    type_line "/exit"
    wait_for 'PAGEDCHAT-EXIT=0'
    pass "the saved session reopened with its tree and took another turn"
fi

screen > "$WORK/screen.txt"
if grep -qE 'Traceback|internal error' "$WORK/screen.txt"; then fail "a traceback or internal error reached the screen"; fi
pass "no traceback on screen"

# -- the saved session ---------------------------------------------------------------------------------------
"$PYTHON" - "$SESSION_FILE" <<'EOF' || fail "session file check"
import json, os, stat, sys
path = sys.argv[1]
data = json.load(open(path))
assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, "session file is not 0600"
nodes = data["nodes"]
variants = [n for n in nodes if n["variant"]]
assert sorted(n["variant"] for n in variants) == [1, 2, 3], "not every /fork variant was saved"
assert len({n["parent"] for n in variants}) == 1, "variants are not siblings"
assert all(n["token_ids"] and n["role"] == "assistant" for n in variants), "a variant lost its tokens"
assert any(n["interrupted"] for n in nodes), "the interrupted reply was not saved"
replies = [n for n in nodes if n["role"] == "assistant"]
reopened = 1 if os.environ.get("E2E_MODEL") else 0
assert len(replies) == 1 + 1 + 3 + 1 + 1 + reopened, f"expected {7 + reopened} replies, found {len(replies)}"
print(f"ok: session file {path}: {len(nodes)} nodes, variants {[n['id'] for n in variants]}, mode 0600")
EOF
echo "PASS: pagedchat chat end to end in tmux (screen in $WORK/screen.txt)"
