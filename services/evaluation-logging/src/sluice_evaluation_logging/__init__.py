"""Sluice's evaluation-logging service."""
