"""A visit's model pool, fresh or resumed: :func:`fill_pool`, what every strategy's ``train`` shares."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from torch import Tensor

from .states import State, check_signature

__all__ = ["ModelCallback", "fill_pool"]

ModelCallback = Callable[[int, State], None]


def fill_pool(m0: Mapping[str, Tensor], expected: dict, count: int, finished: Sequence[Mapping[str, Tensor]],
              train_model: Callable[[int, list[State]], State], on_model: ModelCallback | None = None) -> list[State]:
    """A visit's model pool, fresh or resumed: what every strategy's ``train`` shares.

    ``pool = [m0, *finished]``; then, for ``j = len(finished)+1 .. count`` in order,
    ``state = train_model(j, pool)`` (the pool so far: ``pool[0]`` is ``m0``), appended to the
    pool and handed to ``on_model(j, state)`` so that the caller can persist it.  Since model
    ``j`` depends only on the pool before it (and the strategy's seed), passing the states
    already trained as ``finished`` gives the result of an uninterrupted visit;
    ``on_model`` is called only for the models trained here.

    Args:
        expected: the state signature (:func:`fedrelay.models.expected_signature` of the
            run's spec) that ``m0`` and every ``finished`` state must have.
        count: the models a visit trains (``models_to_keep(cfg)`` of the strategy).

    Returns:
        The pool, ``count + 1`` states: ``m0``, the ``finished`` states as given, the new ones.

    Raises:
        ValueError: ``m0`` or a ``finished`` state that does not fit ``expected``, more than
            ``count`` finished states, or what ``train_model`` raises.
    """
    check_signature(m0, expected, "m0")
    finished = list(finished)
    if len(finished) > count:
        raise ValueError(f"{len(finished)} finished models, but a visit of this strategy trains {count}")
    for j, state in enumerate(finished, start=1):
        check_signature(state, expected, f"finished model {j}")
    pool: list = [m0, *finished]
    for j in range(len(finished) + 1, count + 1):
        state = train_model(j, pool)
        pool.append(state)
        if on_model is not None:
            on_model(j, state)
    return pool
