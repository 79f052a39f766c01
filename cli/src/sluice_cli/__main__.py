"""`python -m sluice_cli ...` is `sluice ...`."""

from sluice_cli.main import main

main()
