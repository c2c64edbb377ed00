"""A batch needing about twice the pool completes, and greedy outputs equal an unconstrained run."""

import json

import pytest

from cli_util import invoke
from test_engine_equality import prompts
from pagedchat.engine import Engine, EngineConfig, SamplingParams


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_twice_the_pool_equals_unconstrained(model_dirs, arch):
    path, _ = model_dirs[arch]
    batch = prompts(12, seed=11, lo=30, hi=48)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    needed = sum(-(-(len(p) + 24) // 16) for p in batch)
    small = Engine(EngineConfig(model=str(path), num_blocks=needed // 2), show_progress=False)
    big = Engine(EngineConfig(model=str(path), num_blocks=4 * needed), show_progress=False)
    got = [o.outputs[0].token_ids for o in small.generate(batch, params)]
    want = [o.outputs[0].token_ids for o in big.generate(batch, params)]
    assert got == want
    assert small.scheduler.num_preemptions > 0 and small.pool.peak_used <= needed // 2
    small.check_invariants()
    assert small.pool.num_used == 0


def test_cli_small_kv_memory_matches_unconstrained(model_dirs, tmp_path, capsys, monkeypatch):
    path, _ = model_dirs["llama"]
    texts = [f"the quick brown fox {i} jumps over the lazy dog " * 3 for i in range(10)]
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    common = ["run", "-m", str(path), "--raw", "--json", "--temperature", "0", "--max-tokens", "20",
              "--file", str(batch)]
    # one 16-token block of this model = 2 layers x (K+V) x 16 tokens x 2 heads x 16 dims x 4 bytes = 8 KiB
    code, out, err = invoke(common + ["--kv-memory", "96KiB"], None, capsys, monkeypatch)
    assert code == 0, err
    small = json.loads(out)
    code, out, err = invoke(common, None, capsys, monkeypatch)
    big = json.loads(out)
    assert small["kv"]["num_blocks"] == 12
    assert [r["outputs"][0]["token_ids"] for r in small["results"]] == \
        [r["outputs"][0]["token_ids"] for r in big["results"]]
