"""What the trial scripts' command lines share (``deploy/local_trial.py``, ``make demo``, and
``deploy/netns_trial.py``): the Fashion-MNIST files made available, the options after ``--``
split off and checked by ``coordinator start-chain``'s own parser before any process starts, and
the guard that turns SIGTERM and Ctrl-C into an orderly stop."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

__all__ = ["DEBIAN_DIR", "ensure_fashion_mnist", "chain_args_problem", "split_chain_args", "guarded"]

DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")


def ensure_fashion_mnist(source: Path | None) -> None:
    """Make the Fashion-MNIST IDX files available, installing Debian's package when possible."""
    if source is not None or any(DEBIAN_DIR.glob("train-images-idx3-ubyte*")):
        return
    if os.geteuid() == 0 and shutil.which("apt-get"):
        print("Fashion-MNIST not found: installing Debian's dataset-fashion-mnist (apt-get) ...", flush=True)
        ok = subprocess.call(["apt-get", "install", "-y", "-q", "dataset-fashion-mnist"]) == 0
        if not ok:
            subprocess.call(["apt-get", "update", "-q"])
            ok = subprocess.call(["apt-get", "install", "-y", "-q", "dataset-fashion-mnist"]) == 0
        if ok and any(DEBIAN_DIR.glob("train-images-idx3-ubyte*")):
            return
    sys.exit(
        "Fashion-MNIST IDX files are missing. Get them one of these ways, then run again:\n"
        "  - Debian/Ubuntu, as root:  apt-get install -y dataset-fashion-mnist\n"
        f"    (puts them in {DEBIAN_DIR})\n"
        "  - or download train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz,\n"
        "    t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz from\n"
        "    https://github.com/zalandoresearch/fashion-mnist (data/fashion) into a folder\n"
        "    and pass --source FOLDER (make demo SOURCE=FOLDER)."
    )


def chain_args_problem(chain_args: list[str]) -> str | None:
    """What is wrong with the options after ``--`` for ``coordinator start-chain`` (None: nothing),
    found by start-chain's own parser before any process starts: an unknown option, or a
    strategy, order, selection... that is not one of its choices (the message lists them)."""
    import typer.main
    from typer._click import exceptions

    from fedrelay.cli.coordinator import app

    command = typer.main.get_command(app).commands["start-chain"]
    args = [*chain_args, *([] if any(a == "--seed" or a.startswith("--seed=") for a in chain_args) else ["--seed", "0"])]
    try:
        command.make_context("start-chain", args, resilient_parsing=False)
    except exceptions.ClickException as exc:
        return f"coordinator start-chain {' '.join(chain_args)}: {exc.format_message()}"
    except exceptions.Exit:
        return None
    return None


def split_chain_args(argv: list[str] | None) -> tuple[list[str], list[str]]:
    """A trial script's command line (None: ``sys.argv[1:]``) split at the first ``--``: the
    script's own options, and those it passes to ``coordinator start-chain`` (none without ``--``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def guarded(body, interrupted: str) -> int:
    """Run a trial script's ``body`` (returns an exit status) so that SIGTERM and Ctrl-C unwind
    it like an exception, letting every ``with LocalTrial`` block stop its processes (and
    namespaces): exit 130 then, with ``interrupted`` printed; 1 with the message on a
    ``RuntimeError``."""
    def _terminate(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored
    try:
        return body()
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
