"""Subcommands of the `pagefleet` CLI, one module each (see `pagefleet.cli`)."""
