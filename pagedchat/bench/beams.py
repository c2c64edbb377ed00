"""`pagedchat bench memory --beams W`: what beam search holds in the paged pool, against one sequence and
against a contiguous per-beam cache (what transformers' beam search keeps: W full copies of the history).

No model runs: the real Engine (scheduler, pool, beam search) steps with a stand-in runner whose logits are a
fixed pseudo-random function of each beam's last two tokens, peaked like a language model's. Beams therefore
branch, merge into the same few continuations and die the way they do over a real model, and the block
counts are the engine's own.
"""

from __future__ import annotations

import torch

PROMPTS = (1024, 2048)
VOCAB = 64
PEAK = 3.0     # logit scale: a few tokens carry most of the probability, as in a trained model


class PseudoModelRunner:
    """Logits over VOCAB tokens from the last two tokens of each sampled sequence (deterministic)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks

    def run(self, batch):
        samplers = [seq for seq, n in batch.items if seq.num_computed + n == seq.num_tokens]
        if not samplers:
            return None, []
        rows = []
        for seq in samplers:
            gen = torch.Generator().manual_seed(hash((seq.token_ids[-1], seq.token_ids[-2])) % 2**63)
            rows.append(torch.randn(VOCAB, generator=gen) * PEAK)
        return torch.stack(rows), samplers


def measure_beam_memory(prompt_len: int, width: int, new_tokens: int, block_size: int) -> dict:
    """Blocks in use at every step for one beam search, one plain sequence, and W contiguous copies."""
    prompt = [t % VOCAB for t in range(7, 7 + prompt_len)]
    beam = follow_blocks(_pseudo_engine(prompt_len, new_tokens, block_size, width), prompt, width, new_tokens)
    single = follow_blocks(_pseudo_engine(prompt_len, new_tokens, block_size, 0), prompt, 0, new_tokens)
    return beam_memory_summary(prompt_len, width, block_size, beam, single)


def beam_memory_summary(prompt_len: int, width: int, block_size: int, beam: dict, single: dict) -> dict:
    """One prompt's figures from follow_blocks() of a beam search and of one sequence over it; the
    contiguous per-beam cache holds W whole histories (prompt + tokens so far) at every step."""
    new_tokens = len(single["used"]) + 1
    contiguous = [width * -(-(prompt_len + t) // block_size) for t in range(1, new_tokens + 1)]
    peak_one = single["peak"]
    return {
        "prompt_tokens": prompt_len,
        "peak_blocks": beam["peak"], "mean_blocks": _mean(beam["used"]),
        "one_sequence_peak_blocks": peak_one, "one_sequence_mean_blocks": _mean(single["used"]),
        "contiguous_peak_blocks": max(contiguous), "contiguous_mean_blocks": _mean(contiguous),
        "peak_ratio_vs_one": beam["peak"] / peak_one,
        "contiguous_peak_ratio_vs_one": max(contiguous) / peak_one,
        "cow_copies": beam["cow_copies"], "max_copies_per_step": beam["max_copies"],
        "blocks_over_time": beam["used"], "one_sequence_blocks_over_time": single["used"],
        "contiguous_blocks_over_time": contiguous,
    }


def beam_pool_blocks(prompt_len: int, new_tokens: int, block_size: int, width: int) -> int:
    """Room for every beam unshared: the measurement never preempts."""
    return (width or 1) * -(-(prompt_len + new_tokens + 1) // block_size) + 8


def _pseudo_engine(prompt_len: int, new_tokens: int, block_size: int, width: int):
    from pagedchat.engine import Engine, EngineConfig
    from pagedchat.engine.core.seams import NoModel

    max_len = prompt_len + new_tokens + 1
    num_blocks = beam_pool_blocks(prompt_len, new_tokens, block_size, width)
    config = EngineConfig(model="(simulated)", device="cpu", block_size=block_size, num_blocks=num_blocks,
                          max_num_seqs=256, max_num_batched_tokens=max_len, max_model_len=max_len,
                          overlap=False)   # one token a step: the blocks are followed token by token
    return Engine(config, loaded=NoModel(max_model_len=max_len, vocab_size=VOCAB),
                  runner=PseudoModelRunner(num_blocks))


def follow_blocks(engine, prompt: list[int], width: int, new_tokens: int) -> dict:
    """Run one request (beam search with `width` beams, or one greedy sequence for 0) alone on a fresh
    engine: the pool's blocks in use after every step, its peak, and the block copies (most in one step)."""
    from pagedchat.engine import SamplingParams

    pool = engine.pool
    assert pool.num_used == 0 and pool.peak_used == 0, "the peak must be this request's alone"
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, beam_width=width)
    rid = engine.add_request(prompt, params)
    used, copies, max_copies = [], 0, 0
    while not engine.is_finished(rid):
        engine.step()
        max_copies, copies = max(max_copies, pool.cow_copies - copies), pool.cow_copies
        if not engine.is_finished(rid):
            # after the step's beam selection: dropped beams are already freed, the new ones share the rest
            used.append(pool.num_used)
    out = engine.pop_output(rid)
    assert pool.num_used == 0 and not out.error, out.error
    return {"used": used, "peak": pool.peak_used, "cow_copies": pool.cow_copies, "max_copies": max_copies}


def _mean(values: list[int]) -> float:
    return sum(values) / len(values) if values else 0.0


def run_beam_memory_bench(width: int, new_tokens: int = 64, block_size: int = 16,
                          prompts: tuple[int, ...] = PROMPTS) -> dict:
    runs = [measure_beam_memory(p, width, new_tokens, block_size) for p in prompts]
    return {"width": width, "new_tokens": new_tokens, "block_size": block_size, "runs": runs}


def plot_beam_memory(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pagedchat.bench.common import save_figure

    runs = result["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(4.5 * len(runs), 3.6), squeeze=False)
    for ax, r in zip(axes[0], runs):
        steps = range(1, len(r["blocks_over_time"]) + 1)
        ax.plot(steps, r["contiguous_blocks_over_time"][:len(steps)], color="tab:red", lw=1.2,
                label=f"contiguous, {result['width']} copies")
        ax.plot(steps, r["blocks_over_time"], color="tab:blue", lw=1.4, label=f"paged beam={result['width']}")
        ax.plot(range(1, len(r["one_sequence_blocks_over_time"]) + 1), r["one_sequence_blocks_over_time"],
                color="grey", lw=1, ls="--", label="paged, one sequence")
        ax.set_title(f"{r['prompt_tokens']}-token prompt: peak {r['peak_ratio_vs_one']:.2f}x one sequence",
                     fontsize=9)
        ax.set_xlabel("engine step")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"blocks allocated (block {result['block_size']})")
    axes[0][0].legend(fontsize=7)
    save_figure(fig, path)
    plt.close(fig)


def print_beam_report(result: dict) -> None:
    from pagedchat.bench.common import print_table

    w, runs = result["width"], result["runs"]
    hf = all("hf_beam_kv_blocks" in r for r in runs)   # bench chat on a real model: the peer's own cache
    print_table(f"beam search, {w} beams, {result['new_tokens']} new tokens: blocks allocated",
                ["prompt", "beam peak", "beam mean", "one seq peak", f"contiguous x{w} peak", "peak vs one",
                 "contiguous vs one", "max copies/step"] + (["transformers KV (blocks)"] if hf else []),
                [[r["prompt_tokens"], r["peak_blocks"], r["mean_blocks"], r["one_sequence_peak_blocks"],
                  r["contiguous_peak_blocks"], r["peak_ratio_vs_one"], r["contiguous_peak_ratio_vs_one"],
                  r["max_copies_per_step"]] + ([r["hf_beam_kv_blocks"]] if hf else []) for r in runs])
