"""Tiered checkpoint store: formats, atomic commit, catalog."""
