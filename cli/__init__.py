"""Typer apps behind the console scripts `peer`, `coordinator` and `fedrelay` (no logic of their own)."""
