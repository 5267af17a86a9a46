"""The face: command line, settings, store commands, verify."""
