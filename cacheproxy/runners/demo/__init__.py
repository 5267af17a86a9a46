"""The demo model: its corpus, recipe and shipped weights."""
