"""The `sluice` command line: a client of a running Sluice, in its own environment (no service imports it)."""
