"""The `pagedchat` command line. Each sub-command lives in pagedchat/commands/ and registers itself here."""

from __future__ import annotations

import importlib
import os
import sys

import typer

app = typer.Typer(
    name="pagedchat",
    help="Chat, fork and compare LLM replies locally on one shared paged KV-cache pool.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)



@app.callback()
def _root() -> None:
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


_register_commands()


def _invoke() -> None:
    """Parse and run the command line. Not through `app(standalone_mode=False)`: typer's wrapper then
    returns a command's `raise typer.Exit(code)` as a value (every exit code was lost: failures exited 0) and
    turns Ctrl-C into a silent Exit(130). Invoked directly, both reach the handlers in main()."""
    command = typer.main.get_command(app)
    with command.make_context("pagedchat", sys.argv[1:]) as ctx:
        command.invoke(ctx)


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
            e.show()
            sys.exit(e.exit_code)
        if debug:
            raise
        print(f"pagedchat: internal error: {type(e).__name__}: {e} (run with --debug for the traceback)",
              file=sys.stderr)
        sys.exit(1)

if __name__ == "__main__":
    main()
