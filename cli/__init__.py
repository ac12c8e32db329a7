"""Typer apps behind the console scripts `peer` and `coordinator` (no logic of their own)."""
