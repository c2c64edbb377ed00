"""Engine.close() gives back what the engine took: afterwards nothing references the pool's caches, the decode
graphs or (when the engine loaded it) the model, so their memory can be freed. The device-side check,
torch.cuda.memory_reserved() back where it was, is a `gpu` test (test_gpu_engine.py)."""

import gc
import weakref

from graph_double import capture_on_cpu
from oracle import assert_greedy_equal, reference
from pagedchat.engine import Engine, EngineConfig, SamplingParams
from pagedchat.model.loader import load_model

GREEDY = SamplingParams(temperature=0, max_tokens=6)


def _held(engine) -> dict[str, weakref.ref]:
    runner = engine.runner
    return {"k cache": weakref.ref(runner.k_caches[0]),
            "v cache": weakref.ref(runner.v_caches[-1]), "graphs": weakref.ref(runner.graphs),
            "graph output": weakref.ref(runner.graphs.graphs[1][1]), "model": weakref.ref(runner.model),
            "weight": weakref.ref(next(runner.model.parameters()))}


def _holders(obj) -> list[str]:
    """What still refers to obj (for the failure message): the referrers' types and, for dicts, their owners."""
    out = []
    for ref in gc.get_referrers(obj):
        owners = [type(o).__name__ for o in gc.get_referrers(ref) if hasattr(o, "__dict__") and o.__dict__ is ref]
        out.append(f"{type(ref).__name__}{' of ' + ', '.join(owners) if owners else ''}")
    return out


def test_close_drops_every_reference_to_the_pool_graphs_and_model(model_dirs):
    engine = Engine(EngineConfig(model=str(model_dirs["qwen3_moe"][0]), num_blocks=64, kv_ram="1MiB"),
                    show_progress=False)   # the RAM tier holds the runner: it must not hold the model through it
    capture_on_cpu(engine.runner, 2)
    kept = engine.generate([[5, 6, 7], [8, 9]], GREEDY, keep=True)   # pinned branches outlive the close
    held = _held(engine)
    engine.close()
    gc.collect()
    alive = {name: ref() for name, ref in held.items() if ref() is not None}
    assert not alive, {name: _holders(obj) for name, obj in alive.items()}
    assert kept[0].outputs[0].token_ids      # what the caller holds is plain data
    engine.close()                           # a second close does nothing


def test_closing_an_engine_leaves_a_shared_model_and_a_newer_engines_pool(model_dirs):
    path, hf = model_dirs["llama"]
    loaded = load_model(str(path), "cpu", "float32", show_progress=False)
    older = Engine(EngineConfig(model=str(path), num_blocks=64), loaded=loaded, show_progress=False)
    newer = Engine(EngineConfig(model=str(path), num_blocks=64), loaded=loaded, show_progress=False)
    older_cache = weakref.ref(older.runner.k_caches[0])
    older.close()
    gc.collect()
    assert older_cache() is None
    assert all(layer.k_cache is cache for layer, cache in zip(loaded.model.attention_layers(), newer.runner.k_caches))
    prompt = [5, 6, 7, 8]
    assert_greedy_equal(newer.generate([prompt], GREEDY)[0].outputs[0].token_ids, *reference(hf, prompt, 6))
