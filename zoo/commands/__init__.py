"""Subcommands of the ``zoo`` command line, one module each."""
