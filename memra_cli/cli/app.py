"""The `memra` typer app: assembles one module per subcommand."""

from __future__ import annotations

import sys

import typer
from typer.core import TyperGroup

from memra_cli import __version__
from memra_cli.cli import bench, census, generate, parity, quantize, serve, train
from memra_cli.cli.common import (
    Terminated, click_module, debug_enabled, describe, report_signal, signals_as_exceptions, usage_error_line,
)


class _MemraGroup(TyperGroup):
    """The command group, with one convention for every bad input: a single `error:` line on
    stderr and exit 2 (typer would draw a boxed usage error for a bad flag value, an unknown
    option or an unknown subcommand; memra's own refusals were already one line). While a
    command runs, SIGTERM / SIGHUP unwind it like Ctrl-C, so its cleanups run."""

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        from memra_cli.engine.errors import MemraError

        click = click_module().exceptions
        try:
            with signals_as_exceptions():  # SIGTERM cleans up as Ctrl-C does
                rv = super().main(*args, standalone_mode=False, **kwargs)
            code = rv if isinstance(rv, int) else 0
        except Terminated as exc:  # outside a command (while parsing): nothing to clean up
            code = report_signal(exc.signum)
        except click.UsageError as exc:
            code = _usage_error(exc)
        except click.ClickException as exc:
            print(f"error: {' '.join(exc.format_message().split())}", file=sys.stderr)
            code = exc.exit_code
        except MemraError as exc:  # raised by an option callback, before any command ran
            if debug_enabled():
                raise
            print(f"error: {describe(exc)}", file=sys.stderr)
            code = exc.exit_code
        if standalone_mode:
            sys.exit(code)
        return code


def _usage_error(exc) -> int:
    """Print a usage error as one `error:` line (or the help, when no arguments were given)."""
    if type(exc).__name__ == "NoArgsIsHelpError":  # `memra` alone: the help, as before
        text = exc.format_message()  # empty when typer's rich help already printed itself
        if text.strip():
            print(text, file=sys.stderr)
        return exc.exit_code
    print(f"error: {usage_error_line(exc)}", file=sys.stderr)
    return exc.exit_code


app = typer.Typer(
    name="memra",
    cls=_MemraGroup,
    help="Block-diffusion speculative decoding toolkit: inspect, quantize, check and run DFlash / DSpark drafters.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command(name="census")(census.census)
app.command(name="quantize")(quantize.quantize)
app.command(name="generate")(generate.generate)
app.command(name="parity")(parity.parity)
app.command(name="bench")(bench.bench)
app.command(name="serve")(serve.serve)
app.command(name="train")(train.train)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"memra {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version and exit.")) -> None:
    """memra: inspect, quantize, check and run block-diffusion drafters."""


def main() -> None:
    app()
