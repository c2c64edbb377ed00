"""`pagedchat bench ...`: measure the memory and speed claims against the alternative, in the same run."""

from __future__ import annotations

from typing import Optional

import typer

from pagedchat.errors import UserError

bench = typer.Typer(help="Benchmarks: pagedchat against the alternative, measured in the same run.",
                    no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(bench, name="bench")


JSON = typer.Option(False, "--json", help="Print one JSON object (for scripts) instead of tables.")
PLOT = typer.Option(None, "--plot", help="Write a PNG picture of the run to FILE.png.")


@bench.command("memory", help="The real block pool and scheduler on a synthetic trace vs contiguous max-len "
                              "reservation (no model needed).")
def memory(
    requests: int = typer.Option(1000, "--requests", help="Requests in the trace (all queued at once)."),
    max_len: int = typer.Option(2048, "--max-len", help="Longest request (prompt + output); what contiguous "
                                                        "reservation sets aside per request."),
    mean_prompt: float = typer.Option(300, "--mean-prompt", help="Mean prompt tokens (lognormal; the shared "
                                                                 "prefix comes on top)."),
    mean_output: float = typer.Option(200, "--mean-output", help="Mean output tokens (lognormal)."),
    sigma: float = typer.Option(1.0, "--sigma", help="Lognormal shape of both lengths (0 = all equal)."),
    block_size: int = typer.Option(16, "--block-size", help="Tokens per KV block (power of two)."),
    pool_tokens: int = typer.Option(65536, "--pool-tokens", help="KV pool size in tokens, for both sides."),
    shared_prefix: int = typer.Option(0, "--shared-prefix", help="Tokens of a system prompt common to all."),
    variants: int = typer.Option(8, "--variants", help="N for the variants measurement (N forks of one "
                                                       "max-len-ish history)."),
    variant_tail: int = typer.Option(32, "--variant-tail", help="Tokens each variant decodes after the fork."),
    max_batched_tokens: int = typer.Option(2048, "--max-batched-tokens", help="Per-step token budget."),
    max_seqs: int = typer.Option(0, "--max-seqs", help="Cap on running requests (0 = memory is the limit)."),
    seed: int = typer.Option(0, "--seed", help="Trace seed: same seed, same numbers."),
    sweep: bool = typer.Option(True, "--sweep/--no-sweep", help="Block-size sweep 8..128 (tail waste vs "
                                                                "table size)."),
    as_json: bool = JSON,
    plot: Optional[str] = PLOT,
) -> None:
    from pagedchat.bench.common import print_json
    from pagedchat.bench.memory import TraceParams, print_memory_report, run_memory_bench

    params = TraceParams(requests=requests, max_len=max_len, mean_prompt=mean_prompt, mean_output=mean_output,
                         sigma=sigma, block_size=block_size, pool_tokens=pool_tokens, shared_prefix=shared_prefix,
                         variants=variants, variant_tail=variant_tail, max_batched_tokens=max_batched_tokens,
                         max_seqs=max_seqs, seed=seed)
    result = run_memory_bench(params, sweep=sweep, plot=_plot_path(plot))
    print_json(result) if as_json else print_memory_report(result)


@bench.command("kernels", help="The Triton paged-attention kernels against copy bandwidth and SDPA (CUDA).")
def kernels(as_json: bool = JSON, plot: Optional[str] = PLOT) -> None:
    import inspect

    from pagedchat.bench.common import print_json

    try:
        from pagedchat.bench.kernels import run_kernel_bench
    except ImportError as e:
        raise UserError(f"the kernel benchmark is not available in this build ({e})") from None
    accepted = inspect.signature(run_kernel_bench).parameters
    offered = {"as_json": as_json, "json": as_json, "plot": _plot_path(plot)}
    result = run_kernel_bench(**{k: v for k, v in offered.items() if k in accepted})
    if as_json and isinstance(result, dict):
        print_json(result)


def _plot_path(plot: Optional[str]) -> Optional[str]:
    if plot is None:
        return None
    if not plot.lower().endswith(".png"):
        raise UserError(f"--plot wants a .png file name, got {plot!r}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'pagedchat[plot]'") from None
    return plot
