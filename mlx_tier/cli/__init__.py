"""The ``mlx-tier`` command line: :mod:`mlx_tier.cli.main` holds the Typer app and lists the commands."""
