"""The `pagedchat` command line. Each sub-command lives in pagedchat/commands/ and registers itself here."""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
from typing import Optional

from pagedchat import threads as _threads

_threads.prepare_environment()  # before anything imports torch

import typer  # noqa: E402

app = typer.Typer(
    name="pagedchat",
    help="Chat, fork and compare LLM replies locally on one shared paged KV-cache pool.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if value:
        from pagedchat import __version__

        print(f"pagedchat {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                       help="Print the version and exit."),
          debug: bool = typer.Option(False, "--debug", help="Show the traceback of an error (also "
                                                             "PAGEDCHAT_DEBUG=1); works anywhere on the line.")
          ) -> None:
    """Chat, fork and compare LLM replies locally on one shared paged KV-cache pool."""


# Modules that define sub-commands; each has `register(app)`. Heavy imports stay inside the commands.
COMMAND_MODULES = ["run", "chat", "sessions", "models", "serve", "bench", "cache"]


def _register_commands() -> None:
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"pagedchat.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"pagedchat.commands.{name}":
                continue  # command not built yet
            raise
        module.register(app)


THREADS = typer.Option(None, "--threads", help="CPU threads for torch (default: $PAGEDCHAT_THREADS, else the "
                                               "physical cores).")


def _with_threads(fn):
    """`fn` as a command that also takes --threads N and applies it before running."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def command(*args, threads: Optional[int] = None, **kwargs):
        _threads.apply_threads(threads)
        return fn(*args, **kwargs)

    option = inspect.Parameter("threads", inspect.Parameter.KEYWORD_ONLY, default=THREADS,
                               annotation=Optional[int])
    command.__signature__ = signature.replace(parameters=[*signature.parameters.values(), option])
    command.__annotations__ = {**fn.__annotations__, "threads": Optional[int]}
    return command


def _add_threads_option(typer_app: typer.Typer) -> None:
    """Every command takes --threads (the commands that time other systems define their own meaning)."""
    for info in typer_app.registered_commands:
        if info.callback is not None and "threads" not in inspect.signature(info.callback).parameters:
            info.callback = _with_threads(info.callback)
    for group in typer_app.registered_groups:
        _add_threads_option(group.typer_instance)


_register_commands()
_add_threads_option(app)


def _invoke() -> None:
    """Parse and run the command line. Not through `app(standalone_mode=False)`: typer's wrapper then
    returns a command's `raise typer.Exit(code)` as a value (every exit code was lost: failures exited 0) and
    turns Ctrl-C into a silent Exit(130). Invoked directly, both reach the handlers in main()."""
    command = typer.main.get_command(app)
    _no_flag_types(command)
    with command.make_context("pagedchat", sys.argv[1:]) as ctx:
        command.invoke(ctx)


def _no_flag_types(command) -> None:
    """--help shows no type for on/off flags (typer labels them <bool>, as if they took a value)."""
    for param in command.params:
        if getattr(param, "is_flag", False):
            param.metavar = ""
    make_help = command.get_help_option

    def help_option(ctx):
        option = make_help(ctx)
        if option is not None:
            option.metavar = ""
        return option

    command.get_help_option = help_option
    for sub in getattr(command, "commands", {}).values():
        _no_flag_types(sub)


def main() -> None:
    """Entry point: user errors become one line on stderr and a non-zero exit; --debug shows tracebacks."""
    from pagedchat.errors import UserError
    from pagedchat.settings import cli_words

    debug = "--debug" in sys.argv or os.environ.get("PAGEDCHAT_DEBUG") == "1"
    if "--debug" in sys.argv:
        sys.argv.remove("--debug")
    try:
        _invoke()
    except UserError as e:
        if debug:
            raise
        print(f"pagedchat: error: {cli_words(e)}", file=sys.stderr)   # engine settings named as flags
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        if debug:
            raise
        print("pagedchat: interrupted", file=sys.stderr)
        sys.exit(130)
    except (typer.Exit, SystemExit) as e:
        code = getattr(e, "exit_code", getattr(e, "code", 0))
        sys.exit(code or 0)
    except EOFError:  # end of input where a command asked for some: like Ctrl-C
        print("pagedchat: interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:  # the reader went away (`pagedchat run ... | head -1`): nothing left to say
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        sys.exit(1)
    except Exception as e:
        # Usage errors come from click (or the copy typer vendors): recognise them by their class names.
        names = {c.__name__ for c in type(e).__mro__}
        if "Abort" in names:
            print("pagedchat: interrupted", file=sys.stderr)
            sys.exit(130)
        if "ClickException" in names and not debug:
            print(f"pagedchat: error: {_usage_line(e, names)}", file=sys.stderr)
            sys.exit(e.exit_code)
        if debug:
            raise
        print(f"pagedchat: internal error: {type(e).__name__}: {e} (run with --debug for the traceback)",
              file=sys.stderr)
        sys.exit(1)

def _usage_line(error, names: set[str]) -> str:
    """A click usage error in one line, as README promises (click prints four: usage, a hint, a blank line
    and the message): the message, then where the help is."""
    message = " ".join(error.format_message().split()).rstrip(".")
    message = message[:1].lower() + message[1:]
    ctx = getattr(error, "ctx", None)
    if "UsageError" in names and ctx is not None:
        message += f" (see {ctx.command_path} --help)"
    return message


def console_main() -> None:
    """The installed `pagedchat` command: main(), then, once every output is flushed, an immediate exit.
    Tearing down the interpreter (torch's modules and tensors) takes most of a second and does nothing a
    finished command needs: files are written and closed by the commands themselves."""
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away: nothing left to deliver
            code = code or 1
    if "logging" in sys.modules:
        sys.modules["logging"].shutdown()
    os._exit(code)


if __name__ == "__main__":
    console_main()
