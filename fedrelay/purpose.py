"""A transfer's purpose, in the one vocabulary every part of fedrelay uses.

A run moves models for three purposes (``coordinator/plan.py`` says when):

==========  =====================  =======================  ==============  ======================
word        ``fedrelay.v1.Purpose``  in the ledger (``hops``)  said to a user   what it carries
==========  =====================  =======================  ==============  ======================
``hop``     ``CHAIN_HOP``           ``chain``                "hop"           predecessor -> successor
``final``   ``FINAL_MODEL``         ``final``                "final model"   the final model, to every other site
``upload``  ``UPLOAD``              ``upload``               "upload"        a star site's payload -> the aggregator
==========  =====================  =======================  ==============  ======================

The **word** is the name in code, in plans (:class:`fedrelay.coordinator.plan.Transfer`) and in
file names; the wire carries the enum; the ledger's ``purpose`` column and the metrics' label
keep ``chain`` for a hop (the word of every ledger written so far), so ``ledger`` words are
converted only at those two edges.
"""

from __future__ import annotations

from fedrelay.v1 import common_pb2

__all__ = ["HOP", "FINAL", "UPLOAD", "WORDS", "LEDGER_WORDS", "BY_WIRE", "WIRE_ERROR", "to_wire", "from_wire", "to_ledger",
           "from_ledger", "ledger_of_wire", "wire_of_ledger", "said"]

HOP, FINAL, UPLOAD = "hop", "final", "upload"
WORDS = (HOP, FINAL, UPLOAD)

_WIRE = {HOP: common_pb2.CHAIN_HOP, FINAL: common_pb2.FINAL_MODEL, UPLOAD: common_pb2.UPLOAD}
_FROM_WIRE = {v: k for k, v in _WIRE.items()}
#: The word of each ``fedrelay.v1.Purpose`` value (e.g. for envelope file names and ``--json``).
BY_WIRE = dict(_FROM_WIRE)
_LEDGER = {HOP: "chain", FINAL: "final", UPLOAD: "upload"}
_FROM_LEDGER = {v: k for k, v in _LEDGER.items()}
_SAID = {HOP: "hop", FINAL: "final model", UPLOAD: "upload"}

#: The ledger's words, in the order the ledger and the metrics list them (hops, uploads, final copies).
LEDGER_WORDS = (_LEDGER[HOP], _LEDGER[UPLOAD], _LEDGER[FINAL])
#: What a report or stream with an unknown purpose is told.
WIRE_ERROR = "purpose must be CHAIN_HOP, UPLOAD or FINAL_MODEL"


def to_wire(word: str) -> int:
    """The ``fedrelay.v1.Purpose`` of ``word``. Raises ``ValueError`` for an unknown word."""
    try:
        return _WIRE[word]
    except KeyError:
        raise ValueError(f"unknown transfer purpose {word!r}") from None


def from_wire(value: int) -> str:
    """The word of a ``fedrelay.v1.Purpose`` value. Raises ``ValueError`` (unspecified or unknown)."""
    try:
        return _FROM_WIRE[value]
    except KeyError:
        raise ValueError(f"unknown transfer purpose {value}") from None


def to_ledger(word: str) -> str:
    """The ledger's word for ``word`` (``chain`` for a hop). Raises ``KeyError``."""
    return _LEDGER[word]


def from_ledger(word: str) -> str:
    """The word of a ledger purpose. Raises ``KeyError``."""
    return _FROM_LEDGER[word]


def ledger_of_wire(value: int) -> str | None:
    """The ledger's word of a ``fedrelay.v1.Purpose`` value; None for an unknown one."""
    word = _FROM_WIRE.get(value)
    return None if word is None else _LEDGER[word]


def wire_of_ledger(word: str) -> int:
    """The ``fedrelay.v1.Purpose`` of a ledger word. Raises ``KeyError``."""
    return _WIRE[_FROM_LEDGER[word]]


def said(value: int | str) -> str:
    """How a message to a user names a purpose (a wire value or a word): "hop", "final model",
    "upload"; an unknown one as "transfer"."""
    word = value if isinstance(value, str) else _FROM_WIRE.get(value)
    return _SAID.get(word, "transfer")
