"""Pure cache decisions: no I/O, no event loop."""
