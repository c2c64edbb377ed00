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
from pagedchat.commands.run_output import (LiveReply, identical_note, json_report, length_note, note,
                                           print_plain)
from pagedchat.errors import UserError
from pagedchat.prompts import require_text
from pagedchat.reasoning import starts_thinking


def register(app: typer.Typer) -> None:
    app.command("run", help="Answer one prompt (argument or stdin), or a --file batch, and exit.")(run)


def run(
    prompt: Optional[str] = typer.Argument(None, help="The prompt; read from stdin when omitted."),
    model: Optional[str] = common.MODEL,
    system: Optional[str] = common.SYSTEM,
    raw: bool = typer.Option(False, "--raw", help="No chat template: encode the prompt as is."),
    num_variants: int = typer.Option(1, "-n", "--num-variants", help="Variants sharing the prompt's KV."),
    beams: int = typer.Option(0, "--beams", help="Beam search with W beams (outputs: W hypotheses, best first)."),
    length_penalty: float = typer.Option(1.0, "--length-penalty",
                                         help="Beam scores are log-prob / length ** X (X > 0 favours long outputs)."),
    early_stopping: str = typer.Option("false", "--early-stopping",
                                       help="Beam search stops: true (W finished), false (heuristic), never."),
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
    context_overflow: Optional[str] = common.CONTEXT_OVERFLOW,
    speculate: Optional[str] = common.SPECULATE,
    num_draft_tokens: Optional[int] = common.NUM_DRAFT_TOKENS,
    draft_model: Optional[str] = common.DRAFT_MODEL,
    kv_disk: Optional[str] = common.KV_DISK,
    kv_ram: Optional[str] = common.KV_RAM,
    quantize: Optional[str] = common.QUANTIZE,
    kv_dtype: Optional[str] = common.KV_DTYPE,
    server: Optional[str] = common.SERVER,
    logprobs: Optional[int] = typer.Option(None, "--logprobs", metavar="N",
                                           help="With --json: each output token's logprob and N alternatives."),
    json_schema: Optional[Path] = typer.Option(None, "--json-schema", metavar="FILE",
                                               help="Constrain every output to this JSON schema."),
) -> None:
    model_opts = common.ModelOptions(model=model, device=device, dtype=dtype, block_size=block_size,
                                    kv_memory=kv_memory, max_context=max_context, speculate=speculate,
                                    num_draft_tokens=num_draft_tokens, draft_model=draft_model,
                                    server=server, quantize=quantize, kv_disk=kv_disk, kv_ram=kv_ram,
                                    kv_dtype=kv_dtype)
    sampling = common.SamplingOptions(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                      max_tokens=max_tokens, seed=seed, repetition_penalty=repetition_penalty,
                                      stop=stop)
    if num_variants < 1:
        raise UserError(f"-n must be >= 1, got {num_variants}")
    in_session = session is not None or continue_last
    _check_combination(prompt, file, session, continue_last, raw, system)
    common.check_overflow(context_overflow, "--context-overflow")
    beam = _beam_settings(beams, length_penalty, early_stopping, num_variants, in_session)
    if logprobs is not None and (not as_json or in_session):
        raise UserError("--logprobs is reported in --json output: add --json (not with --session/-c)")
    if json_schema is not None and in_session:
        raise UserError("--json-schema is for one-shot prompts, not --session/-c (in chat: /set schema FILE)")
    # Everything checkable without torch is checked before it loads: bad flags fail in a fraction of a second.
    common.check_before_load(model_opts, sampling, model_from_session=model is None and in_session)
    if in_session:
        from pagedchat.chat.oneshot import run_in_session

        text = _prompt_text(prompt)
        code = run_in_session(model_opts, sampling, text, session, continue_last, system, num_variants, as_json,
                              context_overflow)
        raise typer.Exit(code)
    jobs = _read_batch(file) if file is not None else [{"prompt": _prompt_text(prompt)}]
    grammar = _schema_grammar(json_schema)
    remote = _remote(model_opts, logprobs, grammar)
    entry = remote[1] if remote else common.resolve_entry(model_opts)
    params_list = []
    for i, job in enumerate(jobs):
        overrides = {k: job[k] for k in common.SamplingOptions.__dataclass_fields__ if k in job}
        params, _ = common.resolve_sampling(entry, sampling, {**overrides, "__source__": f"{file} line {i + 1}"})
        params_list.append(params.with_(n=job["n"] if job.get("n") is not None else num_variants,
                                        logprobs=logprobs, grammar=grammar, **beam))
    engine = remote[0] if remote else _quick_engine(model_opts, entry, params_list) \
        or common.load_engine(model_opts, show_progress=not as_json)[0]
    default_system = system if system is not None else entry.get("system_prompt").value
    requests = [(_prompt_ids(engine, job, raw, default_system), params) for job, params in zip(jobs, params_list)]
    if _quick_prompt_too_long(engine, requests):
        engine.close()
        engine = common.load_engine(model_opts, show_progress=not as_json)[0]
    thinking = None if raw or engine.tokenizer is None else [_opens_thinking(engine, ids) for ids, _ in requests]
    if remote:
        messages = [_job_messages(job, default_system) for job in jobs]
        code = _generate_remote(engine, entry.name, requests, messages, as_json, file is not None, thinking)
    else:
        try:
            code = _generate(engine, entry.name, requests, as_json, batch=file is not None, thinking=thinking)
        finally:
            engine.close()  # the prompts' KV goes to the disk tier: the next run with the same prefix loads it
    raise typer.Exit(code)


def _prompt_ids(engine, job: dict, raw: bool, default_system) -> list[int]:
    text = job["prompt"]
    if raw:
        return engine.encode(text)
    if engine.tokenizer is None:    # a server whose model has no local tokenizer: chat messages only
        return []
    return common.chat_prompt_ids(engine, text, job.get("system", default_system))


def _quick_engine(model_opts, entry, params_list: list):
    """The torch-free engine (pagedchat/quick) for one prompt it runs as the engine would; None otherwise."""
    from pagedchat.quick.engine import takes

    if len(params_list) != 1 or not takes(params_list[0]):
        return None
    from pagedchat import quick

    return quick.open_engine(common.engine_config(model_opts, entry))


def _quick_prompt_too_long(engine, requests: list) -> bool:
    """A prompt the engine's batched prefill answers sooner, its start-up included (quick.QUICK_PROMPT_MAX)."""
    from pagedchat.quick import QUICK_PROMPT_MAX
    from pagedchat.quick.engine import QuickEngine

    return isinstance(engine, QuickEngine) and len(requests[0][0]) > QUICK_PROMPT_MAX


def _remote(model_opts, logprobs, grammar):
    """(RemoteBackend, entry) when a server generates (--server, or a kind = "remote" entry); else None.
    The backend stands in for the engine where a prompt is rendered (tokenizer, encode)."""
    if not common.is_remote(model_opts):
        return None
    from pagedchat.chat.remote_backend import open_remote

    if logprobs is not None or grammar is not None:
        raise UserError(f"{'--logprobs' if logprobs is not None else '--json-schema'} needs the local engine: "
                        f"not available with --server")
    return open_remote(model_opts)


def _job_messages(job: dict, default_system) -> list[dict]:
    system = job.get("system", default_system)
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": job["prompt"]}]


def _generate_remote(backend, model_name: str, requests: list, messages: list, as_json: bool, batch: bool,
                     thinking) -> int:
    """_generate's twin for a server: the prompts one after another (the server batches across its own
    clients), streamed, with the same plain and --json output plus a "remote" object."""
    start = time.perf_counter()
    live = _live_reply(requests, as_json, batch, thinking)
    seen: dict[int, int] = {}      # characters of each variant already fed

    def write(index: int, so_far: str) -> None:
        live.feed(index, so_far[seen.get(index, 0):])
        seen[index] = len(so_far)

    outputs, first_token_at, interrupted = [], None, False
    for (ids, params), turn in zip(requests, messages):
        done = backend.generate(ids, params, None, write if live else None, messages=turn)
        out = done.output
        outputs.append(out)
        if first_token_at is None and out.ttft_s is not None:
            first_token_at = start + out.ttft_s
        if done.interrupted:
            interrupted = True
            break
    total = time.perf_counter() - start
    if as_json:
        report = json_report(backend, model_name, outputs, batch, start, first_token_at, total, thinking)
        print(json.dumps({**report, "remote": backend.describe()}))
    else:
        _show_plain(live, outputs, requests, batch, thinking, backend.max_model_len, interrupted)
    if interrupted:
        print("pagedchat: interrupted", file=sys.stderr)
        return 130
    return 0


def _beam_settings(beams: int, length_penalty: float, early_stopping: str, num_variants: int,
                   in_session: bool) -> dict:
    """--beams/--length-penalty/--early-stopping as SamplingParams fields (transformers' meanings)."""
    stopping = {"true": True, "false": False, "never": "never"}.get(early_stopping.strip().lower())
    if stopping is None:
        raise UserError(f"--early-stopping must be true, false or never, got {early_stopping!r}")
    if beams < 0:
        raise UserError(f"--beams must be >= 1, got {beams}")
    if beams and num_variants > 1:
        raise UserError("--beams returns W hypotheses itself: leave out -n")
    if beams and in_session:
        raise UserError("--beams does not continue a session; use /beam W in `pagedchat chat`")
    return {"beam_width": beams, "length_penalty": length_penalty, "early_stopping": stopping}


def _check_combination(prompt, file, session, continue_last: bool, raw: bool, system) -> None:
    """Options that cannot work together are refused by name, never silently dropped."""
    if file is not None and prompt is not None:
        raise UserError("give a prompt or --file, not both")
    if session is not None and continue_last:
        raise UserError("give --session NAME or -c (the most recent session), not both")
    in_session = "--session" if session is not None else "-c" if continue_last else None
    if in_session and file is not None:
        raise UserError(f"{in_session} continues one conversation and --file runs a batch of independent "
                        f"prompts: give one or the other")
    if in_session and raw:
        raise UserError(f"{in_session} continues a chat, which uses the chat template; --raw has no template")
    if raw and system is not None:
        raise UserError("--system needs the chat template; --raw has none")


def _schema_grammar(path: Path | None):
    if path is None:
        return None
    from pagedchat.engine.core.grammar import GrammarSpec

    return GrammarSpec.from_schema_file(path)


def _prompt_text(prompt: str | None) -> str:
    """The prompt argument, else stdin. Bytes that are not UTF-8 arrive as lone surrogates and would fail
    later inside the tokenizer: refuse them here, saying where they came from."""
    text = require_text(prompt, "prompt") if prompt is not None else _read_stdin()
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
    """A line's own settings, checked one by one before the model loads, so the error names the line. An
    unknown key (a typo like "temprature") is an error: ignoring it would run with a setting not asked for."""
    from pagedchat.engine import SamplingParams

    keys = [*common.SamplingOptions.__dataclass_fields__, "n"]
    known = {"prompt", "system", *keys}
    unknown = [k for k in job if k not in known]
    if unknown:
        raise UserError(f"{path}:{number}: unknown key {unknown[0]!r}; a line takes: {', '.join(sorted(known))}")
    require_text(job["prompt"], f"prompt on line {number} of {path}")
    try:
        SamplingParams(**{k: job[k] for k in keys if job.get(k) is not None})
    except UserError as e:
        raise UserError(f"{path}:{number}: {e}") from None
    if job.get("system") is not None and not isinstance(job["system"], str):
        raise UserError(f"{path}:{number}: \"system\" must be a string")


def _opens_thinking(engine, ids: list[int]) -> bool:
    return starts_thinking(engine.tokenizer.decode(ids[-8:]))


def _generate(engine, model_name: str, requests: list, as_json: bool, batch: bool, thinking=None) -> int:
    """thinking: per prompt, whether its reply starts inside <think> (None: --raw, no reasoning split).
    Ctrl-C ends the run after the current step: what was generated is printed (marked interrupted), exit 130."""
    from pagedchat.chat.backend import stop_on_ctrl_c

    start = time.perf_counter()
    ids, refused = _add_all(engine, requests, batch)
    live = _live_reply(requests, as_json, batch, thinking)
    first_token_at, ctrl_c = None, _CtrlC()
    with stop_on_ctrl_c(ctrl_c), closing(engine.steps([r for r in ids if r is not None])) as steps:
        for events in steps:    # closing the driver early aborts what is unfinished (its blocks freed)
            first_token_at = first_token_at or (time.perf_counter() if events else None)
            for event in events if live is not None else ():
                live.feed(event.index, event.text, event.finish_reason)
            if ctrl_c.pressed:
                break
    total = time.perf_counter() - start
    outputs = [engine.pop_output(r) if r is not None else refused[i] for i, r in enumerate(ids)]
    if as_json:
        print(json.dumps(json_report(engine, model_name, outputs, batch, start, first_token_at, total, thinking)))
    else:
        _show_plain(live, outputs, requests, batch, thinking, engine.max_model_len, ctrl_c.pressed)
    errors = [f"prompt {i + 1}: {o.error}" if batch else o.error for i, o in enumerate(outputs) if o.error]
    for message in dict.fromkeys(errors):
        print(f"pagedchat: error: {message}", file=sys.stderr)
    if ctrl_c.pressed:
        print("pagedchat: interrupted", file=sys.stderr)
        return 130
    return 1 if errors else 0


class _CtrlC:
    """Set by the SIGINT handler (chat/backend.py `stop_on_ctrl_c`); read between two steps."""
    pressed = False

    def stop(self) -> None:
        self.pressed = True


def _live_reply(requests: list, as_json: bool, batch: bool, thinking) -> LiveReply | None:
    """One prompt, printed as it is generated (a batch and beam hypotheses print once done)."""
    params = requests[0][1]
    if as_json or batch or params.beam_width:
        return None
    return LiveReply(params.n, None if thinking is None else thinking[0])


def _show_plain(live, outputs, requests, batch: bool, thinking, max_model_len, interrupted: bool) -> None:
    """The rest of the plain output, then its notes on stderr."""
    if live is not None:
        live.finish(outputs[0])
    else:
        print_plain(outputs, batch, thinking)
    sys.stdout.flush()
    if not sys.stdout.isatty():     # a terminal shows a dim [length] after the cut reply itself
        cut = length_note(outputs, [p.max_tokens for _, p in requests], max_model_len, batch)
        if cut:
            note(cut)
    params = requests[0][1]
    if not interrupted and not batch and not params.beam_width:
        same = identical_note(outputs[0], params.temperature)
        if same:
            note(same)


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
