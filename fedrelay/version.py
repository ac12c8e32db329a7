"""fedrelay's version (``pyproject.toml``'s ``version``), which the daemons report to each other
and a final model's metadata records. ``fedrelay.__version__`` is the same string."""

__version__ = "0.1.0"
