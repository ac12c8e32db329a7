"""What BatchNorm statistics cost a run's final model (issue #25 item 1: "a normalisation that
survives label skew along a chain (GroupNorm in the CNN, or BatchNorm statistics carried along
the chain: measure both)").

In a chain the BatchNorm running statistics travel with the model, but each site's training
overwrites them with its own data's (momentum 0.1 over hundreds of batches): the final model
carries statistics of the last site, which under Dirichlet 0.1 holds one to three classes. Any
scheme that carries statistics along the chain can at best give the final weights the statistics
of all the sites' data. :class:`BnOracle` computes exactly those: it recomputes every BatchNorm
layer's running mean and variance over the union of the sites' training splits under the final
weights (PyTorch's cumulative average, ``momentum=None``, the task's training transform, no
gradient), and evaluates the result on the union of the test splits, as the daemons' global
accuracy does. No site holds that union, so the figure is an oracle: the most that carrying
BatchNorm statistics along the chain could add to the final model, not a method. ``bench.grid``
records it in each daemon cell (``bn_oracle``) and its report reads it per recipe and Dirichlet.

The measurement runs in the benchmark's process, after the run, on a file of the final model in
the trial's state dirs (:func:`final_model_file`, found by the ledger's SHA-256); it changes
nothing in the run.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["BnOracle", "final_model_file"]


def final_model_file(trial_dir: Path, cell: dict) -> Path:
    """A file of ``cell``'s final model in a ``LocalTrial``'s state dirs
    (``<trial_dir>/state/<site>/runs/<run id>/``): the copy a site got for evaluation
    (``final.safetensors``), or the final site's own ``outgoing.safetensors`` (a chain's final
    site keeps no copy), whichever is found first whose SHA-256 is the run's.

    Raises:
        FileNotFoundError: no such file has the run's digest (``cell["sha256"]``).
    """
    runs = sorted(Path(trial_dir).glob(f"state/*/runs/{cell['run_id']}"))
    final = Path(trial_dir) / "state" / str(cell.get("final_site")) / "runs" / str(cell["run_id"])
    for path in [final / "final.safetensors", final / "outgoing.safetensors"] + [r / "final.safetensors" for r in runs]:
        if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == cell["sha256"]:
            return path
    raise FileNotFoundError(f"no file of run {cell['run_id']}'s final model (SHA-256 {cell['sha256'][:12]}…) "
                            f"under {trial_dir}/state")


class BnOracle:
    """The sites' data of one split, to measure final models against; loaded at the first
    :meth:`measure` (so that making one costs nothing, and a split that cannot be read fails
    there, as a measurement).

    Args:
        dirs: the split's site folders (image-folder layout, ``train/`` and ``test/``).
        model: the image-folder architecture the runs trained (``cnn``, ``cnn-wide``, ...).
        batch_size: images per forward pass when recomputing the statistics.
    """

    def __init__(self, dirs: list[Path], model: str, batch_size: int = 512):
        self.dirs, self.model, self.batch_size = list(dirs), model, int(batch_size)
        self.spec = None

    def load(self) -> None:
        """Read the sites' folders (once): :attr:`spec`, :attr:`task`, :attr:`test` (images,
        labels), :attr:`train_images`."""
        if self.spec is not None:
            return
        import torch

        from bench.runs import _load_sites
        from fedrelay.tasks import resolve
        from fedrelay.tasks.image_folder import spec as image_spec

        sites, classes = _load_sites(self.dirs)
        c, h, w = sites[0].image_shape
        tests = [s.tensors("test", classes) for s in sites]
        self.test = torch.cat([t[0] for t in tests]), torch.cat([t[1] for t in tests])
        self.train_images = torch.cat([s.tensors("train", classes)[0] for s in sites])
        spec = image_spec(self.model, c, (h, w), len(classes))
        self.task = resolve(spec)
        self.spec = spec  # last: a failed load leaves the oracle unloaded

    def measure(self, path: Path) -> dict | None:
        """The model at ``path`` (safetensors, e.g. :func:`final_model_file`) as it is and with
        the oracle's statistics.

        Returns:
            None when the model has no BatchNorm layer (nothing to recompute), else
            ``{"accuracy": the model as it is, "oracle_accuracy": with the statistics over every
            site's training data, "bn_layers": how many}``; accuracies are fractions of the union
            of the sites' test splits.

        Raises:
            OSError: the file or the sites' folders cannot be read; ValueError: a site folder that
            is not one; ``safetensors``' own errors for a file that is not one.
        """
        self.load()
        import torch
        from safetensors.torch import load_file

        from fedrelay.models import build_model
        from fedrelay.peer.training import evaluate

        state = load_file(str(path))
        net = build_model(self.spec)
        net.load_state_dict(state)
        norms = [m for m in net.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        if not norms:
            return None

        def accuracy() -> float:
            net.eval()
            correct, total = evaluate(net, *self.test, device="cpu", task=self.task)
            return correct / total

        before = accuracy()
        for m in norms:
            m.reset_running_stats()
            m.momentum = None  # cumulative average over every batch
            m.train()  # the rest stays in eval mode (accuracy() left it so): only the statistics change
        with torch.no_grad():
            for start in range(0, len(self.train_images), self.batch_size):
                net(self.task.batch(self.train_images[start:start + self.batch_size], train=True))
        return {"accuracy": before, "oracle_accuracy": accuracy(), "bn_layers": len(norms)}
