"""Shared building blocks of the Sluice services."""
