"""A toy parallel method with two options, for tests/test_new_method.py: everything a new method
needs, in one module. Its registry entries (:data:`METHODS`) declare the options; the CLI's
flags, the config file's keys, the checks, the wire and the typed dict handed to the functions
below all follow from them. Registered in-process with ``fedrelay.registry.register(*METHODS)``,
and in every daemon with ``FEDRELAY_METHODS=toy_method:METHODS`` (this folder on PYTHONPATH).

The aggregator is the uniform mean of the uploads (``average_states``); each call writes the
options it was handed, with their Python types, to a JSON file in the folder named by
``TOY_METHOD_RECORD`` (when set), so that a test can see what reached the method.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from fedrelay.registry import STAR, Aggregator, Option, Strategy

RECORD_ENV = "TOY_METHOD_RECORD"
OPTION_NAMES = ("toy_repeats", "toy_weight")

METHODS = (
    Aggregator("toy-mean", "a toy: the uniform mean of the uploads (tests/toy_method.py)", "toy_method", options=(
        Option("toy_repeats", int, 1, "toy: how many times the toy says so (1 to 3).", minimum=1, maximum=3),
        Option("toy_weight", float, 0.5, "toy: a weight in (0, 1].", minimum=0.0, maximum=1.0, positive=True),
    )),
    Strategy("toy", "a toy parallel method: one model per site, the uniform mean of them (tests)", STAR,
             "fedrelay.peer.strategies.fedseq", aggregator="toy-mean"),
)


def _record(stage: str, options: dict) -> None:
    folder = os.environ.get(RECORD_ENV)
    if not folder:
        return
    mine = {name: [type(options[name]).__name__, options[name]] for name in OPTION_NAMES if name in options}
    Path(folder, f"{stage}-{uuid.uuid4().hex}.json").write_text(json.dumps({"stage": stage, "options": mine}))


def extras_schema(spec, options: dict) -> dict:
    """No extra tensors."""
    return {}


def site_extras(state, spec, train, options: dict, device="cpu") -> dict:
    """Nothing besides the model (the options handed here are recorded)."""
    _record("site", options)
    return {}


def aggregate(uploads, ctx):
    """The uniform mean of the uploads' states (the options handed here are recorded)."""
    from fedrelay.peer.states import average_states

    _record("aggregate", ctx.options)
    return average_states([u.state for u in uploads])
