"""A site's own work (peer/local_work.py): the receiver of a chain hop is told to start its worker
(``Peer.Prepare``) only once this site's own worker holds its slot, never before: a worker the
receiver starts ahead on the same host must not take the slot this site's training waits for."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

from fedrelay.peer import local_work
from fedrelay.peer.local_work import LocalWork
from fedrelay.peer.slots import HostSlots


def test_the_receiver_is_told_once_this_sites_worker_holds_its_slot(tmp_path, monkeypatch):
    slots = HostSlots(1, tmp_path / "slots")
    events: list[str] = []

    def run(req, *, run_id, on_event, cancelled, on_wait, on_start):  # WorkerPool.run's slot, then its job
        with slots.acquire() as slot:
            events.append(f"slot {slot.index} held")
            on_start()
            events.append("trained")
        return {"pool": 1, "seconds": 0.0}

    site = SimpleNamespace(name="site-a", train_lock=threading.Lock(), jobs=SimpleNamespace(run=run),
                           set_state=lambda run, state, detail="": events.append(state), stop=threading.Event())
    work = LocalWork(site, SimpleNamespace(initial_state=lambda run: None))

    def tell(run, r):
        # what the receiver's daemon does with Prepare: start a worker ahead only if a slot is free
        taken = slots.try_acquire()
        events.append(f"told (receiver found a free slot: {taken is not None})")
        if taken is not None:
            taken.release()

    monkeypatch.setattr(work, "tell_receiver", tell)
    monkeypatch.setattr(local_work, "job_base", lambda site, run: {})
    monkeypatch.setattr(local_work.TrainJob, "from_dict", staticmethod(lambda req: req))
    monkeypatch.setattr(local_work.privacy, "enabled", lambda params: False)
    a = SimpleNamespace(position=1, rounds=1, params=None)
    run_ = SimpleNamespace(run_id="r", assignment=a, visit_dir=lambda r: Path(tmp_path), inbound=lambda r: None,
                           is_star=False, ended=threading.Event())
    work.train(run_, 1, tmp_path / "out.safetensors")
    assert events == ["slot 0 held", "training", "told (receiver found a free slot: False)", "trained"]
