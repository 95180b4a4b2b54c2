"""The `memra` command line: typer app, one module per subcommand, rendering in render.py."""
