"""The `memra` typer app: assembles one module per subcommand."""

from __future__ import annotations

import typer

from memra_cli import __version__
from memra_cli.cli import bench, census, generate, parity, quantize

app = typer.Typer(
    name="memra",
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


def _version(value: bool) -> None:
    if value:
        typer.echo(f"memra {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version and exit.")) -> None:
    """memra: inspect, quantize, check and run block-diffusion drafters."""


def main() -> None:
    app()
