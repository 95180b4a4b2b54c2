"""The `memra` typer app: assembles one module per subcommand."""

from __future__ import annotations

import itertools
import sys

import typer
from typer.core import TyperCommand, TyperGroup

from memra_cli import __version__
from memra_cli.cli import bench, census, draft_vocab, generate, parity, quantize, serve, train
from memra_cli.cli.common import (
    Terminated, click_module, debug_enabled, describe, flush_stdout, report_signal, signals_as_exceptions,
    usage_error_line,
)


class _MemraGroup(TyperGroup):
    """The command group, with one convention for every bad input: a single `error:` line on
    stderr and exit 2 (typer would draw a boxed usage error for a bad flag value, an unknown
    option or an unknown subcommand; memra's own refusals were already one line). While a
    command runs, SIGTERM / SIGHUP unwind it like Ctrl-C, so its cleanups run."""

    def get_params(self, ctx):
        return _flags_without_placeholder(super().get_params(ctx))

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        """`--version` stands alone: `memra --version extra` is refused, not answered (its eager
        callback would exit 0 before anything else is parsed)."""
        leading = [a for a in itertools.takewhile(lambda a: a.startswith("-"), args)]
        if "--version" in leading and len(args) > 1:
            raise click_module().exceptions.UsageError("--version takes no other arguments", ctx)
        return super().parse_args(ctx, args)

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
        code = flush_stdout(code)
        if standalone_mode:
            sys.exit(code)
        return code


def _usage_error(exc) -> int:
    """Print a usage error as one `error:` line (or the help, when no arguments were given)."""
    if type(exc).__name__ == "NoArgsIsHelpError":  # `memra` alone: the help
        text = exc.format_message()  # empty when typer's rich help already printed itself
        if text.strip():
            print(text, file=sys.stderr)
        return exc.exit_code
    print(f"error: {usage_error_line(exc)}", file=sys.stderr)
    return exc.exit_code


VALUE_METAVARS = {"str": "TEXT", "int": "INTEGER", "float": "FLOAT", "Path": "PATH"}


class _MemraCommand(TyperCommand):
    """A subcommand whose help reads as the docs write it: a flag shows no value placeholder
    (typer's would be `<bool>`), an option's value is TEXT / INTEGER / PATH, an argument is its
    name in capitals (`CKPT [ORACLE]` in the usage line, not `{ckpt} [oracle]`), and the
    docstring's paragraphs are joined into sentences (typer keeps its line breaks)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.help = command_help(self.help or "")
        for param in self.params:
            if param.param_type_name == "argument":
                param.metavar = param.name.upper()
                kind = _value_metavar(param)  # typer's argument type column ignores the metavar
                param.display_type_rich = lambda ctx, kind=kind: kind
                if getattr(param, "type_descriptor", None) is None:
                    _type_metavar(param, kind)
            elif not getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = _value_metavar(param)

    def get_params(self, ctx):
        return _flags_without_placeholder(super().get_params(ctx))

    def collect_usage_pieces(self, ctx) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":
                pieces.append(param.metavar if param.required else f"[{param.metavar}]")
        return pieces


def _flags_without_placeholder(params: list) -> list:
    """A flag takes no value: no placeholder in the help (click adds --help after __init__)."""
    for param in params:
        if getattr(param, "is_flag", False):
            param.metavar = ""
    return params


def _type_metavar(param, kind: str) -> None:
    """An older typer's argument type column asks the click type for its metavar (and prints
    `<path>` when it has none): a copy of the type that answers `kind`, converting as before."""
    import copy

    param.type = copy.copy(param.type)
    param.type.get_metavar = lambda *args, **kwargs: kind


def _value_metavar(param) -> str:
    descriptor = getattr(param, "type_descriptor", None)  # newer typer; older ones keep click's type
    if descriptor is None:
        return param.type.name.upper()  # click's names: text, integer, float, path, choice
    kind = "Path" if descriptor.is_path else param.bare_type()
    return VALUE_METAVARS.get(kind, kind.upper())


def command_help(doc: str) -> str:
    """A docstring as help text: paragraphs kept, each one's lines joined into one (a line that
    starts a list item, `1.` or `-`, starts a new line)."""
    import inspect
    import re

    paragraphs = []
    for block in inspect.cleandoc(doc).split("\n\n"):
        lines: list[str] = []
        for line in block.splitlines():
            if lines and not re.match(r"\s*(\d+\.|-) ", line):
                lines[-1] += " " + line.strip()
            else:
                lines.append(line.strip())
        paragraphs.append("\n".join(lines))
    return "\n\n".join(paragraphs)


app = typer.Typer(
    name="memra",
    cls=_MemraGroup,
    help="Block-diffusion speculative decoding toolkit: inspect, quantize, check and run DFlash / DSpark drafters.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command(name="census", cls=_MemraCommand)(census.census)
app.command(name="quantize", cls=_MemraCommand)(quantize.quantize)
app.command(name="generate", cls=_MemraCommand)(generate.generate)
app.command(name="parity", cls=_MemraCommand)(parity.parity)
app.command(name="bench", cls=_MemraCommand)(bench.bench)
app.command(name="serve", cls=_MemraCommand)(serve.serve)
app.command(name="train", cls=_MemraCommand)(train.train)
app.command(name="draft-vocab", cls=_MemraCommand)(draft_vocab.draft_vocab)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"memra {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version and exit.")) -> None:
    """memra: inspect, quantize, check and run block-diffusion drafters."""


def main() -> None:
    app()
