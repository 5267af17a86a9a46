"""Observability: metrics and logs."""
