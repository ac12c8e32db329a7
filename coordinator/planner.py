"""Chain planning: which sites, in which order, with which class index and model.

Pure functions on the peers' registrations (no network, no ledger), so that the same seed and
the same sites always give the same plan.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

from fedrelay.registry import ARCHS

ORDERS = ("random", "given")


class PlanError(ValueError):
    """The requested chain cannot be built; the message says why and what to do."""


@dataclass(frozen=True)
class PeerInfo:
    name: str
    address: str
    classes: dict[str, tuple[int, int]]  # class name -> (train images, test images)
    shape: tuple[int, int, int]          # (C, H, W)
    device: str = "cpu"

    @property
    def train_images(self) -> int:
        return sum(t for t, _ in self.classes.values())


@dataclass
class ChainPlan:
    order: list[PeerInfo]
    class_index: list[str]
    model: dict            # ModelSpec fields: arch, in_channels, height, width, num_classes
    warnings: list[str] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.order]


def plan_chain(peers: list[PeerInfo], *, names: list[str] | None = None, order: str = "random",
               seed: int = 0, arch: str = "cnn") -> ChainPlan:
    """Plan a chain over ``names`` (default: every peer given).

    - order ``random``: the sorted names shuffled by ``random.Random(seed)`` (so the seed alone
      fixes the order, whatever order the peers registered in); ``given``: ``names`` as listed.
    - class index: the sorted union of the sites' class names; label i is ``class_index[i]`` at
      every site. A site may lack classes (label skew); a class held by one site only is
      reported in ``warnings`` (often a misspelt folder name).
    - model: ``arch`` with the sites' common image shape and ``len(class_index)`` classes.

    Raises ``PlanError``: fewer than 2 sites, unknown or repeated names, differing image shapes,
    a site without training images, unknown arch or order.
    """
    if arch not in ARCHS:
        raise PlanError(f"unknown model {arch!r}: choose one of {', '.join(ARCHS)}")
    if order not in ORDERS:
        raise PlanError(f"unknown order {order!r}: choose one of {', '.join(ORDERS)}")
    by_name = {p.name: p for p in peers}
    if names:
        dup = [n for n, c in Counter(names).items() if c > 1]
        if dup:
            raise PlanError(f"site listed more than once: {', '.join(dup)}")
        unknown = [n for n in names if n not in by_name]
        if unknown:
            known = ", ".join(sorted(by_name)) or "none"
            raise PlanError(f"not registered with the coordinator: {', '.join(unknown)} (registered: {known})")
        chosen = [by_name[n] for n in names]
    else:
        if order == "given":
            raise PlanError("--order given needs --peers a,b,... in the order wanted")
        chosen = [by_name[n] for n in sorted(by_name)]
    if len(chosen) < 2:
        raise PlanError(f"a chain needs at least 2 sites, got {len(chosen)}")
    if order == "random":
        chosen = sorted(chosen, key=lambda p: p.name)
        random.Random(seed).shuffle(chosen)
    shapes = {p.shape for p in chosen}
    if len(shapes) > 1:
        detail = "; ".join(f"{p.name}: {'x'.join(map(str, p.shape))}" for p in chosen)
        raise PlanError(f"the sites' images differ in channels or size (C x H x W): {detail}")
    empty = [p.name for p in chosen if p.train_images == 0]
    if empty:
        raise PlanError(f"sites without training images: {', '.join(empty)}")
    holders: dict[str, list[str]] = {}
    for p in chosen:
        for cls, (train, test) in p.classes.items():
            if train + test > 0:
                holders.setdefault(cls, []).append(p.name)
    class_index = sorted(holders)
    warnings = [
        f"class {cls!r} is held by one site only ({sites[0]}): check the folder name"
        for cls, sites in sorted(holders.items()) if len(sites) == 1
    ]
    c, h, w = shapes.pop()
    model = {"arch": arch, "in_channels": c, "height": h, "width": w, "num_classes": len(class_index)}
    return ChainPlan(order=chosen, class_index=class_index, model=model, warnings=warnings)
