"""Runs the Sluice services as separate local processes (for `make run`, tests and benchmarks)."""

from sluice_stack.launcher import REPO_ROOT, VARIANT_MODEL, ServiceProcess, Stack, StackPorts, free_port, free_ports

__all__ = ["REPO_ROOT", "VARIANT_MODEL", "ServiceProcess", "Stack", "StackPorts", "free_port", "free_ports"]
