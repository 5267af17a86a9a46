"""Runners: what generates an answer (in-process mlx-lm, or an upstream mlx_lm.server pool)."""
