"""Batch-1 rows of `pagedchat bench throughput`: what one person at a terminal waits for.

  - decode    one prompt, N new tokens (EOS ignored): tokens per second of the decode phase alone
  - prefill   one 512-token prompt: time to its first token
  - decode16  16 prompts of mixed lengths decoding together: tokens per second once every prompt is
              prefilled (decode only; transformers: one padded batch; llama.cpp: one batch of 16 sequences)
  - start-up  `pagedchat run` with the demo model, process start to the first byte on stdout, against the
              wall time of `python -c "import torch"` (the floor every torch program pays)

Systems: the pagedchat engine, transformers `generate` at batch 1, and with `--peer llama.cpp` llama.cpp
through llama-cpp-python on the same weights written as GGUF (F32, F16, Q8_0); when llama-cpp-python is
not installed that peer is skipped with a one-line note. Every system runs in its own subprocess with the
same thread count; the systems take turns and the median of each counts.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pagedchat.bench.common import report_partial
from pagedchat.errors import UserError

PREFILL_TOKENS = 512
LLAMA_CPP_TYPES = ("F32", "F16", "Q8_0")
BATCH_SEQS = 16
BATCH_NEW_TOKENS = 32
STARTUP_PROMPT = "What is 17 + 25?"


def llama_cpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None and importlib.util.find_spec("gguf") is not None


# -- the workers (each in its own process) --------------------------------------------------------------------
def _prompts(spec: dict) -> tuple[list[int], list[list[int]]]:
    """The decode prompt and one distinct 512-token prompt per prefill repeat (no prefix-cache hits)."""
    rng = random.Random(spec["seed"])
    vocab = spec["vocab_size"]
    decode = [rng.randrange(3, vocab) for _ in range(spec["decode_prompt"])]
    prefills = [[rng.randrange(3, vocab) for _ in range(spec["prefill_tokens"])]
                for _ in range(spec["prefill_runs"])]
    return decode, prefills


def _batch_prompts(spec: dict) -> list[list[int]]:
    """BATCH_SEQS prompts of mixed lengths: the throughput table's mix (lognormal, mean 128 tokens), capped so
    every reply fits the context."""
    from pagedchat.bench.throughput import make_prompts

    cap = spec["prefill_tokens"] - spec["batch_new_tokens"]
    return make_prompts(BATCH_SEQS, 128, cap, spec["vocab_size"], spec["seed"] + 1)


def decode_rate_pagedchat(engine, prompts: list[list[int]], params) -> float:
    """Decode-only tok/s of `prompts` decoding together: the clock starts once every prompt has its first
    token."""
    ids = [engine.add_request(p, params) for p in prompts]
    started: set[str] = set()
    while len(started) < len(ids):
        started.update(e.request_id for e in engine.step() if e.token_ids)
    tokens, start = 0, time.perf_counter()
    while engine.has_unfinished():
        tokens += sum(len(e.token_ids) for e in engine.step())
    elapsed = time.perf_counter() - start
    for i in ids:
        engine.pop_output(i)
    return tokens / elapsed


def worker_pagedchat(spec: dict) -> dict:
    from pagedchat.engine import Engine, EngineConfig, SamplingParams

    quantize = {"quantize": spec["quantize"]} if spec.get("quantize") else {}
    config = EngineConfig(model=spec["model"], device="cpu", dtype=spec["dtype"], num_blocks=512, **quantize)
    engine = Engine(config, show_progress=False)
    decode, prefills = _prompts(spec)
    params = SamplingParams(temperature=0, max_tokens=spec["new_tokens"], ignore_eos=True)
    engine.generate([decode[:16]], params.with_(max_tokens=4))  # warm-up
    rid = engine.add_request(decode, params)
    engine.step()  # the prefill, which samples the first token
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    decode_s = time.perf_counter() - start
    engine.pop_output(rid)
    prefill_s = []
    for prompt in prefills:
        start = time.perf_counter()
        engine.generate([prompt], params.with_(max_tokens=1))
        prefill_s.append(time.perf_counter() - start)
    return {"decode_tok_per_s": (spec["new_tokens"] - 1) / decode_s, "prefill_s": statistics.median(prefill_s),
            "decode16_tok_per_s": decode_rate_pagedchat(engine, _batch_prompts(spec),
                                                        params.with_(max_tokens=spec["batch_new_tokens"]))}


def _hf_timed_generate(model, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[float]]:
    """One padded batch (left padding) through `generate`: its wall time and the end of each forward pass (a
    logits processor notes the time; generate reads each step's tokens back, so on a GPU that is the step's
    end too). The first time is the prefill's, each later one a decode step's."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class StepClock(LogitsProcessor):
        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    clock = StepClock()
    _sync(model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, eos_token_id=None, pad_token_id=0,
                       logits_processor=LogitsProcessorList([clock]))
    _sync(model.device)
    return time.perf_counter() - start, clock.times


def _hf_decode_rate(model, prompts: list[list[int]], new_tokens: int) -> float:
    """Decode-only tokens/s: from the end of the prefill to the end of the last step, as pagedchat's and
    llama.cpp's rows time it. (Subtracting a separate prefill-only run's time, as this did before, left the
    difference of two noisy prefills of the padded batch: 16-prompt runs read 544 to 1101 tok/s.)"""
    _, times = _hf_timed_generate(model, prompts, new_tokens)
    return len(prompts) * (new_tokens - 1) / max(times[-1] - times[0], 1e-9)


def _sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def worker_transformers(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
    decode, prefills = _prompts(spec)
    _hf_timed_generate(model, [decode[:16]], 4)  # warm-up
    prefill_s = [_hf_timed_generate(model, [p], 1)[0] for p in prefills]
    return {"decode_tok_per_s": _hf_decode_rate(model, [decode], spec["new_tokens"]),
            "prefill_s": statistics.median(prefill_s),
            "decode16_tok_per_s": _hf_decode_rate(model, _batch_prompts(spec), spec["batch_new_tokens"])}


def worker_llama_cpp(spec: dict) -> dict:
    from llama_cpp import Llama

    prefill = spec["prefill_tokens"]
    llm = Llama(model_path=spec["gguf"], n_ctx=max(1024, prefill + spec["decode_prompt"] + spec["new_tokens"]),
                n_batch=prefill, n_ubatch=prefill, n_threads=spec["threads"],
                n_threads_batch=spec["threads"], verbose=False)
    decode, prefills = _prompts(spec)
    llm.eval(decode[:16])  # warm-up
    llm.reset()
    llm.eval(decode)
    token = decode[-1]
    start = time.perf_counter()
    for _ in range(spec["new_tokens"] - 1):  # one token per call, as in decoding (which token is moot for time)
        llm.eval([token])
    decode_s = time.perf_counter() - start
    prefill_s = []
    for prompt in prefills:
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        prefill_s.append(time.perf_counter() - start)
    del llm
    return {"decode_tok_per_s": (spec["new_tokens"] - 1) / decode_s, "prefill_s": statistics.median(prefill_s),
            "decode16_tok_per_s": decode_rate_llama_cpp(spec["gguf"], _batch_prompts(spec), spec["batch_new_tokens"],
                                                        spec["threads"])}


def decode_rate_llama_cpp(gguf: str, prompts: list[list[int]], n: int, threads: int) -> float:
    """llama.cpp's own multi-sequence batching (as llama-server's slots use it) through the C API: every
    prompt prefilled as its own sequence, then one llama_decode of one token per sequence per step: decode-only
    tok/s. Which token each step feeds is moot for time, so it feeds the last one (no sampling: that flatters
    llama.cpp)."""
    import llama_cpp as L

    model = L.llama_model_load_from_file(gguf.encode(), L.llama_model_default_params())
    params = L.llama_context_default_params()
    params.n_ctx = sum(len(p) for p in prompts) + len(prompts) * n + 256
    params.n_batch = params.n_ubatch = max(512, len(prompts), max(len(p) for p in prompts))
    params.n_seq_max, params.kv_unified = len(prompts), True
    params.n_threads = params.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, params)
    batch = L.llama_batch_init(params.n_batch, 0, len(prompts))

    def decode(items: list[tuple[int, int, int]]) -> None:  # (token, position, sequence)
        batch.n_tokens = len(items)
        for i, (token, pos, seq) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, True
            batch.seq_id[i][0] = seq
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    try:
        for seq, prompt in enumerate(prompts):
            decode([(t, pos, seq) for pos, t in enumerate(prompt)])
        start = time.perf_counter()
        for step in range(n - 1):
            decode([(p[-1], len(p) + step, seq) for seq, p in enumerate(prompts)])
        elapsed = time.perf_counter() - start
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        L.llama_model_free(model)
    return len(prompts) * (n - 1) / elapsed


# -- on a GPU: decode with graphs on and off, time to first token, and the memory-bandwidth floor -------------
def _gpu_prompts(spec: dict) -> tuple[list[int], list[list[int]]]:
    """The decode prompt, and one distinct TTFT prompt per run plus one for the warm-up (no prefix-cache hits)."""
    rng = random.Random(spec["seed"])
    vocab = spec["vocab_size"]
    decode = [rng.randrange(3, vocab) for _ in range(spec["decode_prompt"])]
    ttft = [[rng.randrange(3, vocab) for _ in range(spec["ttft_tokens"])] for _ in range(spec["ttft_runs"] + 1)]
    return decode, ttft


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decode step reads: every parameter and every GGUF layer's blocks once (a tied LM head
    is the embedding table), except that an embedding table the head does not share is read one row at a time."""
    from pagedchat.model.gguf.linear import GGUFLinear

    def size(t) -> int:
        return t.numel() * t.element_size()

    total = sum(size(p) for p in model.parameters())
    total += sum(size(raw) for m in model.modules() if isinstance(m, GGUFLinear) for raw, _ in m.parts)
    embed = getattr(model.embed_tokens, "weight", None)   # none: a GGUF table kept as blocks (uncounted buffers)
    return total if embed is None or embed is getattr(model.lm_head, "weight", None) else total - size(embed)


def device_copy_gbps(device) -> float | None:
    """Device-to-device copy bandwidth (read + write), measured now; None off the GPU."""
    import torch

    if torch.device(device).type != "cuda":
        return None
    from pagedchat.bench.kernels import Timer, measure_ceilings

    return measure_ceilings(torch, Timer(torch, warmup=3, iters=10), torch.bfloat16)[0]


def worker_pagedchat_gpu(spec: dict) -> dict:
    """Batch-1 decode tokens/s and the median time to first token of a fresh prompt, on `spec["device"]`."""
    from pagedchat.engine import Engine, EngineConfig, SamplingParams

    blocks = 4 * -(-(spec["ttft_tokens"] + spec["decode_prompt"] + spec["new_tokens"]) // 16)
    engine = Engine(EngineConfig(model=spec["model"], device=spec["device"], dtype=spec["dtype"], num_blocks=blocks,
                                 max_num_seqs=8, cuda_graphs=spec["graphs"], quantize=spec.get("quantize"),
                                 overlap=spec.get("overlap")),
                    show_progress=False)
    device = engine.device
    decode, ttft_prompts = _gpu_prompts(spec)
    params = SamplingParams(temperature=0, max_tokens=spec["new_tokens"], ignore_eos=True)
    engine.generate([decode[:16], ttft_prompts[0]], params.with_(max_tokens=4))  # warm-up: every kernel shape
    rid = engine.add_request(decode, params)
    engine.step()  # the prefill, which samples the first token
    _sync(device)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    _sync(device)
    decode_s = time.perf_counter() - start
    engine.pop_output(rid)
    ttft = []
    for prompt in ttft_prompts[1:]:
        _sync(device)
        start = time.perf_counter()
        engine.generate([prompt], params.with_(max_tokens=1))   # returns once the token is on the host
        ttft.append(time.perf_counter() - start)
    result = {"decode_tok_per_s": (spec["new_tokens"] - 1) / decode_s, "ttft_s": statistics.median(ttft),
              "graphs": engine.runner.graphs is not None}
    if spec.get("floor"):   # the weight bytes a token reads, and the rate the device copies them
        result.update(weight_bytes=weight_bytes_per_token(engine.runner.model), copy_gbps=device_copy_gbps(device))
    engine.close()
    return result


def worker_transformers_gpu(spec: dict) -> dict:
    from transformers import AutoModelForCausalLM

    from pagedchat.bench.models import torch_dtype

    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch_dtype(spec["dtype"], spec["device"]))
    model = model.to(spec["device"]).eval()
    decode, ttft_prompts = _gpu_prompts(spec)
    _hf_timed_generate(model, [decode[:16], ttft_prompts[0][:64]], 4)  # warm-up
    _hf_timed_generate(model, [ttft_prompts[0]], 1)
    ttft = [_hf_timed_generate(model, [p], 1)[0] for p in ttft_prompts[1:]]
    return {"decode_tok_per_s": _hf_decode_rate(model, [decode], spec["new_tokens"]),
            "ttft_s": statistics.median(ttft)}


WORKERS = {"pagedchat": worker_pagedchat, "transformers": worker_transformers, "llama.cpp": worker_llama_cpp,
           "pagedchat-gpu": worker_pagedchat_gpu, "transformers-gpu": worker_transformers_gpu}


def worker_main(system: str, spec_path: str, out_path: str) -> None:
    import torch

    spec = json.loads(Path(spec_path).read_text())
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    from pagedchat.bench.common import quiet_transformers

    quiet_transformers()
    Path(out_path).write_text(json.dumps(WORKERS[system](spec)))


# -- GGUF for the llama.cpp peer ------------------------------------------------------------------------------
def write_gguf(model_dir: Path, out: Path, kind: str, exact: bool = False) -> Path:
    """The HF llama checkpoint as a GGUF file of `kind` (F32, F16, Q8_0, Q4_0). For timing, Q and K rows are
    not permuted into llama.cpp's rotary layout: the arithmetic is the same, so its speed is, but its tokens
    are not compared with the others'. `exact` gives the model's own logits (perplexity, bench/accuracy.py):
    Q and K rows permuted, and the embedding kept F32 as pagedchat's --quantize keeps it. No vocabulary:
    benchmarks feed token ids."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    config = json.loads((model_dir / "config.json").read_text())
    if (config.get("architectures") or [None])[0] != "LlamaForCausalLM":
        raise UserError("--peer llama.cpp times Llama-architecture models (use --random llama)")
    tensors: dict[str, np.ndarray] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    heads, layers = config["num_attention_heads"], config["num_hidden_layers"]
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_rope_dimension_count(config.get("head_dim") or config["hidden_size"] // heads)
    writer.add_rope_freq_base((config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 1e4)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_tokenizer_model("none")
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
    for i in range(layers):
        for hf, ours in per_layer.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{ours}.weight"
    if "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    kv_heads = config.get("num_key_value_heads") or heads
    for hf_name, name in names.items():
        data = tensors[hf_name].astype(np.float32)
        if exact and name.endswith(("attn_q.weight", "attn_k.weight")):
            data = _rotary_rows(data, heads if name.endswith("attn_q.weight") else kv_heads)
        if data.ndim == 1 or kind == "F32" or (exact and name == "token_embd.weight"):
            writer.add_tensor(name, data)
        elif kind == "F16":
            writer.add_tensor(name, data.astype(np.float16))
        else:
            qtype = getattr(gguf.GGMLQuantizationType, kind)
            quantized = gguf.quants.quantize(data, qtype)
            writer.add_tensor(name, quantized, raw_shape=quantized.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _rotary_rows(weight, heads: int):
    """HF rotates the two halves of each head's dimensions together; llama.cpp's Llama rotates adjacent pairs.
    Reordering each head's rows from (half, pair) to (pair, half) makes its rotation act on the same values."""
    rows, cols = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


# -- start-up -------------------------------------------------------------------------------------------------
def _first_byte_s(cmd: list[str]) -> float:
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    first = proc.stdout.read(1)
    elapsed = time.perf_counter() - start
    proc.stdout.read()
    if proc.wait() != 0 or not first:
        raise UserError(f"start-up run failed: {' '.join(cmd)}")
    return elapsed


def startup_times(threads: int, repeats: int) -> dict:
    """`pagedchat run` (demo model, greedy) vs `python -c "import torch"`, alternating, process start to
    first byte of output."""
    pagedchat = [sys.executable, "-m", "pagedchat.cli", "run", "--threads", str(threads), "--temperature", "0",
                 STARTUP_PROMPT]
    torch_only = [sys.executable, "-c", "import torch; print(1)"]
    runs = {"import torch": [], "pagedchat run": []}
    for _ in range(repeats):
        runs["import torch"].append(_first_byte_s(torch_only))
        runs["pagedchat run"].append(_first_byte_s(pagedchat))
    medians = {k: statistics.median(v) for k, v in runs.items()}
    return {"median_s": medians, "runs_s": runs, "ratio": medians["pagedchat run"] / medians["import torch"]}


# -- the parent -----------------------------------------------------------------------------------------------
def _run(system: str, spec: dict, workdir: Path, timeout: float) -> dict:
    from pagedchat.bench.common import run_worker

    return run_worker("pagedchat.bench.batch1", system, spec, workdir, timeout, f"batch-1 {system}")


def run_batch1_bench(model_path: Path, threads: int, repeats: int = 3, new_tokens: int = 64,
                     decode_prompt: int = 64, peer: str | None = None, quantize: str | None = None,
                     seed: int = 0, timeout: float = 1800) -> dict:
    """Decode and prefill at batch 1 for every system, in turns; the median run of each counts."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    # A model with a short context (the demo's is 512) prefills what fits, one token left to generate.
    prefill = min(PREFILL_TOKENS, config.get("max_position_embeddings", PREFILL_TOKENS + 1) - 1)
    base = {"model": str(model_path), "dtype": "float32", "threads": threads, "new_tokens": new_tokens,
            "decode_prompt": decode_prompt, "prefill_runs": 3, "seed": seed, "vocab_size": config["vocab_size"],
            "prefill_tokens": prefill, "batch_new_tokens": BATCH_NEW_TOKENS}
    systems = {"pagedchat": dict(base), "transformers": dict(base)}
    if quantize:
        systems[f"pagedchat {quantize}"] = {**base, "quantize": quantize}
    notes = []
    with tempfile.TemporaryDirectory(prefix="pagedchat-batch1-") as tmp:
        if peer == "llama.cpp":
            if llama_cpp_available():
                for kind in LLAMA_CPP_TYPES:
                    path = write_gguf(Path(model_path), Path(tmp) / f"model-{kind}.gguf", kind)
                    systems[f"llama.cpp {kind}"] = {**base, "gguf": str(path)}
            else:
                notes.append("llama.cpp peer skipped: llama-cpp-python (and gguf) are not installed "
                             "(pip install llama-cpp-python gguf)")
        runs: dict[str, list[dict]] = {name: [] for name in systems}
        for _ in range(repeats):
            for name, spec in systems.items():
                worker = name.split()[0]
                runs[name].append(_run(worker, spec, Path(tmp), timeout))
    medians = {name: {"decode_tok_per_s": statistics.median(r["decode_tok_per_s"] for r in rs),
                      "prefill_s": statistics.median(r["prefill_s"] for r in rs),
                      "decode16_tok_per_s": statistics.median(r["decode16_tok_per_s"] for r in rs),
                      "decode_runs": [r["decode_tok_per_s"] for r in rs], "prefill_runs": [r["prefill_s"] for r in rs],
                      "decode16_runs": [r["decode16_tok_per_s"] for r in rs]}
               for name, rs in runs.items()}
    ours = medians["pagedchat"]
    ratios = {name: {"decode": ours["decode_tok_per_s"] / m["decode_tok_per_s"],
                     "prefill": m["prefill_s"] / ours["prefill_s"],
                     "decode16": ours["decode16_tok_per_s"] / m["decode16_tok_per_s"]} for name, m in medians.items()}
    return {"threads": threads, "repeats": repeats, "new_tokens": new_tokens, "decode_prompt": decode_prompt,
            "prefill_tokens": prefill, "systems": medians, "pagedchat_ratio": ratios, "notes": notes}


# In the order they run, the rows that goals rest on first (a run cut at a time limit keeps the rows it finished).
GPU_SYSTEMS = {"pagedchat": ("pagedchat-gpu", {"graphs": True, "floor": True}),
               "pagedchat, graphs off": ("pagedchat-gpu", {"graphs": False}),
               "pagedchat int4": ("pagedchat-gpu", {"graphs": True, "quantize": "int4"}),  # --quantize int4
               # the model's shape as a Q4_K_M GGUF file (q4_k_m_file), multiplied as stored (Triton GGUF kernels)
               "pagedchat gguf q4_k_m": ("pagedchat-gpu", {"graphs": True, "floor": True, "gguf": "q4_k_m"}),
               "pagedchat, not overlapped": ("pagedchat-gpu", {"graphs": True, "overlap": False}),
               "transformers generate": ("transformers-gpu", {})}


def q4_k_m_file(config: dict, folder: Path) -> Path:
    """A Llama model of the config's shape written as a Q4_K_M GGUF file in `folder`. Its blocks are random, not
    the model's weights quantized (gguf-py cannot quantize to the K-quants): decode speed depends on the shapes
    and the formats, not on the values. UserError when it cannot be written."""
    if (config.get("architectures") or [None])[0] != "LlamaForCausalLM":
        raise UserError("the GGUF Q4_K_M row is written for Llama-architecture models")
    try:
        from pagedchat.bench.gguf_writer import write_llama_q4_k_m

        return write_llama_q4_k_m(folder / "model-Q4_K_M.gguf", config,
                                  context_length=config["max_position_embeddings"],
                                  tied=bool(config.get("tie_word_embeddings")))
    except ImportError as e:
        raise UserError(f"the GGUF Q4_K_M row needs gguf-py (pip install gguf): {e}") from e
    except ValueError as e:
        raise UserError(str(e)) from e


def run_batch1_gpu(model_path: Path, device: str = "cuda", dtype: str = "auto", decode_prompt: int = 512,
                   new_tokens: int = 256, ttft_tokens: int = 2048, ttft_runs: int = 5, seed: int = 0,
                   timeout: float = 600) -> dict:
    """Batch-1 decode (CUDA graphs on and off) and time to first token against transformers `generate` and
    against the memory-bandwidth floor: weight bytes per token over the measured device copy bandwidth, the
    rate at which a decode that read every weight once per token and did nothing else would run (for the model
    dtype's weights and, in their own row, the same shape's Q4_K_M GGUF blocks). Each system runs once, in its
    own process; a peer that fails is a row with its error."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    if ttft_tokens + 1 > config.get("max_position_embeddings", ttft_tokens + 1):
        raise UserError(f"the model's context ({config['max_position_embeddings']}) is shorter than the "
                        f"{ttft_tokens}-token TTFT prompt")
    base = {"model": str(model_path), "device": device, "dtype": dtype, "decode_prompt": decode_prompt,
            "new_tokens": new_tokens, "ttft_tokens": ttft_tokens, "ttft_runs": ttft_runs, "seed": seed,
            "vocab_size": config["vocab_size"], "threads": None}
    systems, floor = {}, None
    with tempfile.TemporaryDirectory(prefix="pagedchat-batch1-") as tmp:
        for name, (worker, extra) in GPU_SYSTEMS.items():
            try:
                spec = {**base, **extra}
                if "gguf" in extra:
                    spec["model"] = str(q4_k_m_file(config, Path(tmp)))
                m = _run(worker, spec, Path(tmp), timeout)
            except UserError as e:
                if name == "pagedchat":
                    raise
                m = {"error": str(e)}
            if name == "pagedchat":
                floor = bandwidth_floor(m)
            # (the floor is the model dtype's weight bytes: an int4 row reads fewer, so it has none; the GGUF row
            # measured its own bytes, and is held to them)
            systems[name] = m if "error" in m else {**m, "of_floor": _of_floor(m, floor, extra)}
            report_partial({"system": name, "floor": floor, **systems[name]})
    ours, measured = systems["pagedchat"], {name: m for name, m in systems.items() if "error" not in m}
    return {"device": device, "dtype": dtype, "decode_prompt": decode_prompt, "new_tokens": new_tokens,
            "ttft_tokens": ttft_tokens, "ttft_runs": ttft_runs, "floor": floor, "systems": systems,
            "pagedchat_ratio": {name: {"decode": ours["decode_tok_per_s"] / m["decode_tok_per_s"],
                                       "ttft": m["ttft_s"] / ours["ttft_s"]} for name, m in measured.items()}}


def bandwidth_floor(ours: dict) -> dict | None:
    """The rate at which a decode that read every weight byte once per token and did nothing else would run."""
    if not ours.get("copy_gbps"):
        return None
    return {"weight_bytes": ours["weight_bytes"], "copy_gbps": ours["copy_gbps"],
            "tok_per_s": ours["copy_gbps"] * 1e9 / ours["weight_bytes"]}


def _of_floor(m: dict, floor: dict | None, extra: dict) -> float | None:
    """The row's decode rate over its memory-bandwidth floor: the one of its own weight bytes where it measured
    them, the model dtype's for a row that reads those."""
    if m.get("copy_gbps"):
        return m["decode_tok_per_s"] * m["weight_bytes"] / (m["copy_gbps"] * 1e9)
    return m["decode_tok_per_s"] / floor["tok_per_s"] if floor and "quantize" not in extra else None


def print_batch1_gpu_report(r: dict) -> None:
    from pagedchat.bench.common import print_table

    rows = []
    for name, m in r["systems"].items():
        if "error" in m:
            rows.append([name, f"failed: {m['error']}", None, None, None, None])
            continue
        ratio = r["pagedchat_ratio"][name]
        rows.append([name, m["decode_tok_per_s"], m["of_floor"], ratio["decode"], m["ttft_s"] * 1000, ratio["ttft"]])
    floor = r["floor"]
    caption = "pagedchat x: pagedchat's speed over the system's (above 1: pagedchat is faster)"
    if floor:
        caption += (f"; floor: {floor['weight_bytes'] / 1e9:.2f} GB of weights per token at the measured device "
                    f"copy rate {floor['copy_gbps']:,.0f} GB/s = {floor['tok_per_s']:,.0f} tok/s")
    gguf = r["systems"].get("pagedchat gguf q4_k_m", {})
    if gguf.get("weight_bytes"):
        caption += (f"; the GGUF Q4_K_M row (random blocks of the same shape) reads {gguf['weight_bytes'] / 1e9:.2f} "
                    f"GB per token: its floor is its own")
    print_table(f"Batch 1 on {r['device']} ({r['dtype']}) — decode ({r['decode_prompt']}-token prompt, "
                f"{r['new_tokens']} new tokens) and time to first token of a {r['ttft_tokens']}-token prompt "
                f"(median of {r['ttft_runs']})",
                ["system", "decode tok/s", "of the floor", "pagedchat x", "TTFT ms", "pagedchat x"], rows,
                caption=caption)
    if "machine" in r:
        print(f"machine: {r['machine']}")


def print_batch1_report(r: dict) -> None:
    from pagedchat.bench.common import print_table

    rows = [[name, m["decode_tok_per_s"], r["pagedchat_ratio"][name]["decode"], m["prefill_s"] * 1000,
             r["pagedchat_ratio"][name]["prefill"], m["decode16_tok_per_s"], r["pagedchat_ratio"][name]["decode16"]]
            for name, m in r["systems"].items()]
    print_table(f"Batch 1 — decode ({r['decode_prompt']}-token prompt, {r['new_tokens']} new tokens) and "
                f"{r['prefill_tokens']}-token prefill; decode of {BATCH_SEQS} mixed prompts ({BATCH_NEW_TOKENS} "
                f"new tokens each, decode only); {r['threads']} thread(s), median of {r['repeats']} alternating runs",
                ["system", "decode tok/s", "pagedchat x", "prefill ms", "pagedchat x", "16-seq decode tok/s",
                 "pagedchat x"], rows,
                caption="pagedchat x: pagedchat's speed over the system's (above 1: pagedchat is faster)")
    for note in r["notes"]:
        print(note)
    if "startup" in r:
        s = r["startup"]
        print(f"start-up to first byte: pagedchat run {s['median_s']['pagedchat run']:.3f} s, "
              f"import torch {s['median_s']['import torch']:.3f} s: {s['ratio']:.2f}x")
    if "machine" in r:
        print(f"machine: {r['machine']}")


if __name__ == "__main__":
    worker_main(*sys.argv[1:4])
