"""`pagedchat run`: one-shot prompts from an argument, stdin or a JSONL batch file; -n variants; --json."""

from __future__ import annotations

import json
import sys
import time
from contextlib import closing
from pathlib import Path
from typing import Optional

import typer

from pagedchat.commands import common
from pagedchat.errors import UserError
from pagedchat.prompts import require_text


def register(app: typer.Typer) -> None:
    app.command("run", help="Answer one prompt (argument or stdin), or a --file batch, and exit.")(run)


def run(
    prompt: Optional[str] = typer.Argument(None, help="The prompt; read from stdin when omitted."),
    model: Optional[str] = common.MODEL,
    system: Optional[str] = common.SYSTEM,
    raw: bool = typer.Option(False, "--raw", help="No chat template: encode the prompt as is."),
    num_variants: int = typer.Option(1, "-n", "--num-variants", help="Variants sharing the prompt's KV."),
    file: Optional[Path] = typer.Option(None, "--file", help="JSONL batch: one {\"prompt\": ...} per line."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    session: Optional[str] = typer.Option(None, "--session", help="Continue session NAME (created if new)."),
    continue_last: bool = typer.Option(False, "-c", "--continue", help="Continue the most recent session."),
    temperature: Optional[float] = common.TEMPERATURE,
    top_p: Optional[float] = common.TOP_P,
    top_k: Optional[int] = common.TOP_K,
    min_p: Optional[float] = common.MIN_P,
    repetition_penalty: Optional[float] = common.REPETITION_PENALTY,
    max_tokens: Optional[int] = common.MAX_TOKENS,
    seed: Optional[int] = common.SEED,
    stop: Optional[list[str]] = common.STOP,
    device: str = common.DEVICE,
    dtype: Optional[str] = common.DTYPE,
    block_size: int = common.BLOCK_SIZE,
    kv_memory: Optional[str] = common.KV_MEMORY,
    max_context: Optional[int] = common.MAX_CONTEXT,
    quantize: Optional[str] = common.QUANTIZE,
) -> None:
    model_opts = common.ModelOptions(model=model, device=device, dtype=dtype, block_size=block_size,
                                    kv_memory=kv_memory, max_context=max_context, quantize=quantize)
    sampling = common.SamplingOptions(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                      max_tokens=max_tokens, seed=seed, repetition_penalty=repetition_penalty,
                                      stop=stop)
    if num_variants < 1:
        raise UserError(f"-n must be >= 1, got {num_variants}")
    if file is not None and prompt is not None:
        raise UserError("give a prompt or --file, not both")
    if session is not None or continue_last:
        from pagedchat.chat.oneshot import run_in_session

        text = _prompt_text(prompt)
        code = run_in_session(model_opts, sampling, text, session, continue_last, system, num_variants, as_json)
        raise typer.Exit(code)
    jobs = _read_batch(file) if file is not None else [{"prompt": _prompt_text(prompt)}]
    engine, entry = common.load_engine(model_opts, show_progress=not as_json)
    default_system = system if system is not None else entry.get("system_prompt").value
    requests = []
    for i, job in enumerate(jobs):
        overrides = {k: job[k] for k in common.SamplingOptions.__dataclass_fields__ if k in job}
        params, _ = common.resolve_sampling(entry, sampling, {**overrides, "__source__": f"{file} line {i + 1}"})
        params = params.with_(n=job["n"] if job.get("n") is not None else num_variants)
        text = job["prompt"]
        ids = engine.encode(text) if raw else common.chat_prompt_ids(engine, text, job.get("system", default_system))
        requests.append((ids, params))
    code = _generate(engine, entry.name, requests, as_json, batch=file is not None)
    raise typer.Exit(code)


def _prompt_text(prompt: str | None) -> str:
    """The prompt argument, else stdin. Bytes that are not UTF-8 arrive as lone surrogates and would fail
    later inside the tokenizer: refuse them here, saying where they came from."""
    text = prompt if prompt is not None else _read_stdin()
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        where = "the prompt argument" if prompt is not None else "the prompt on stdin"
        raise UserError(f"{where} is not valid UTF-8 text (undecodable byte at character {e.start})") from None
    return text


def _read_stdin() -> str:
    if sys.stdin is None or sys.stdin.isatty():
        raise UserError("no prompt: pass one as an argument, on stdin, or use --file")
    try:
        text = sys.stdin.read()
    except UnicodeDecodeError as e:
        raise UserError(f"the prompt on stdin is not valid UTF-8 text (byte {e.start})") from None
    return require_text(text, "prompt on stdin").rstrip("\n")


def _read_batch(path: Path) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise UserError(f"cannot read --file {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        line = e.object[:e.start].count(b"\n") + 1
        raise UserError(f"{path}:{line}: not valid UTF-8 text (byte 0x{e.object[e.start]:02x})") from None
    jobs = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            job = json.loads(line)
        except ValueError as e:
            raise UserError(f"{path}:{number}: not valid JSON ({e.msg})") from None
        if not isinstance(job, dict) or not isinstance(job.get("prompt"), str):
            raise UserError(f"{path}:{number}: each line must be an object with a string \"prompt\"")
        _check_job(path, number, job)
        jobs.append(job)
    if not jobs:
        raise UserError(f"{path} holds no prompts")
    return jobs


def _check_job(path: Path, number: int, job: dict) -> None:
    """A line's own settings, checked one by one before the model loads, so the error names the line."""
    from pagedchat.engine import SamplingParams

    keys = [*common.SamplingOptions.__dataclass_fields__, "n"]
    try:
        SamplingParams(**{k: job[k] for k in keys if job.get(k) is not None})
    except UserError as e:
        raise UserError(f"{path}:{number}: {e}") from None
    if job.get("system") is not None and not isinstance(job["system"], str):
        raise UserError(f"{path}:{number}: \"system\" must be a string")


def _generate(engine, model_name: str, requests: list, as_json: bool, batch: bool) -> int:
    start = time.perf_counter()
    ids, refused = _add_all(engine, requests, batch)
    stream = not as_json and not batch and requests[0][1].n == 1
    first_token_at = None
    # Ctrl-C leaves the `with`: closing the driver aborts every request (their blocks freed) and re-raises
    with closing(engine.steps([r for r in ids if r is not None])) as steps:
        for events in steps:
            first_token_at = first_token_at or (time.perf_counter() if events else None)
            for event in events:
                if stream and event.text:
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
    total = time.perf_counter() - start
    outputs = [engine.pop_output(r) if r is not None else refused[i] for i, r in enumerate(ids)]
    if as_json:
        print(json.dumps(_json_report(engine, model_name, outputs, batch, start, first_token_at, total)))
    elif stream:
        sys.stdout.write("\n")
    else:
        _print_plain(outputs, batch)
    errors = [f"prompt {i + 1}: {o.error}" if batch else o.error for i, o in enumerate(outputs) if o.error]
    for message in dict.fromkeys(errors):
        print(f"pagedchat: error: {message}", file=sys.stderr)
    return 1 if errors else 0


def _add_all(engine, requests: list, batch: bool) -> tuple[list, dict]:
    """Queue every prompt. In a batch, a prompt too long for the context or the whole pool fails alone (an
    error output in its place) and the others still run; a single prompt's error is the command's error."""
    from pagedchat.engine import CompletionOutput, RequestOutput
    from pagedchat.errors import RequestError

    ids, refused = [], {}
    for i, (prompt_ids, params) in enumerate(requests):
        try:
            ids.append(engine.add_request(prompt_ids, params))
        except RequestError as e:
            if not batch:
                raise UserError(common.cli_words(e)) from None
            ids.append(None)
            message = common.cli_words(e)
            outputs = [CompletionOutput(k, [], "", "error", None, message) for k in range(params.n)]
            refused[i] = RequestOutput(f"refused-{i}", list(prompt_ids), outputs, True, 0, None, None, message)
    return ids, refused


def _print_plain(outputs, batch: bool) -> None:
    for i, out in enumerate(outputs):
        for variant in out.outputs:
            labels = ([f"prompt {i + 1}"] if batch else []) + ([f"variant {variant.index + 1}"]
                                                              if len(out.outputs) > 1 else [])
            if labels:
                print(f"--- {' / '.join(labels)} ---")
            print(variant.text)


def _json_report(engine, model_name, outputs, batch, start, first_token_at, total) -> dict:
    def result(out):
        return {"outputs": [{"text": v.text, "token_ids": v.token_ids, "finish_reason": v.finish_reason}
                            for v in out.outputs],
                "usage": {"prompt_tokens": out.num_prompt_tokens,
                          "completion_tokens": sum(len(v.token_ids) for v in out.outputs)}}

    completion = sum(len(v.token_ids) for o in outputs for v in o.outputs)
    ttft = (first_token_at - start) if first_token_at else None
    decode_time = total - (ttft or 0)
    pool = engine.pool_stats()
    report = {"model": model_name}
    if batch:
        report["results"] = [result(o) for o in outputs]
        report["usage"] = {"prompt_tokens": sum(o.num_prompt_tokens for o in outputs), "completion_tokens": completion}
    else:
        report.update(result(outputs[0]))
    report["kv"] = {"block_size": pool.block_size, "num_blocks": pool.num_blocks, "peak_blocks_used": pool.peak_used,
                    "prefix_hit_tokens": pool.prefix_hit_tokens}
    report["timing"] = {"ttft_s": ttft, "decode_tokens_per_s": (completion - len(outputs)) / decode_time
                        if decode_time > 0 and completion > len(outputs) else None, "total_s": total}
    if any(o.error for o in outputs):
        report["errors"] = [o.error for o in outputs]
    return report
