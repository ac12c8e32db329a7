"""One site's training under NVIDIA FLARE (its Client API), for ``bench.peer_system``.

NVIDIA FLARE's simulator runs this script at every client of a cyclic job
(``nvflare.app_opt.pt.recipes.cyclic.CyclicRecipe``): each time the relay reaches the site it
receives the model (``flare.receive()``), trains it and sends it back (``flare.send()``), and
the server's ``CyclicController`` hands it to the next site.

The training is a plain PyTorch loop written here, not fedrelay's: the field's recipe as a
FLARE user would write it, so that the comparison checks fedrelay's FedSeq against it. Recipe
(the same numbers as a fedrelay run's defaults): Adam (coupled L2 weight decay, as
``torch.optim.Adam(weight_decay=...)``), learning rate ``--lr`` (1e-3), weight decay
``--weight-decay`` (1e-4), mini-batches of ``--batch-size`` (128) images in a shuffled order
(last partial batch kept), float32 pixels ``/ 255``, mean cross-entropy, ``--epochs`` epochs
(``--warmup-epochs`` more at ``--first-site``, as fedrelay's first site warms up), the last
epoch's weights sent on (no selection), BatchNorm statistics included.

Data: the site folder ``<--sites-root>/<site name>`` (what ``coordinator split-dataset``
wrote), read with fedrelay's image-folder loader (``ImageFolderTask().load``); labels are
positions in ``--classes`` (the run's class index). The training images are the ones a fedrelay
daemon trains on: the site's train split less its validation tenth, drawn by fedrelay's
``train_val_split`` with the daemon's seed ``derive_seed(seed, "split", site)``. The shuffle
draws from ``torch.Generator`` seeded by ``derive_seed(seed, "flare", site)`` (its own stream,
so the batch order differs from the daemon's).

Each visit appends one JSON line ``{"site", "round", "train_images", "epochs", "seconds",
"train_loss"}`` to ``--log`` (the study's per-site record).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.nn import functional as F


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sites-root", type=Path, required=True)
    ap.add_argument("--classes", required=True, help="the run's class index, comma-separated")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--epochs", type=int, required=True)
    ap.add_argument("--warmup-epochs", type=int, default=0, help="more epochs at --first-site (fedrelay's warm-up)")
    ap.add_argument("--first-site", default="")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=1e-4)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--log", type=Path, required=True)
    return ap.parse_args(argv)


def site_train_images(root: Path, site: str, classes: list[str], seed: int):
    """The images a fedrelay daemon at ``site`` trains on: uint8 ``N x C x H x W`` and int64
    ``N`` labels (its train split less the validation tenth)."""
    from fedrelay.peer.training import derive_seed, train_val_split
    from fedrelay.tasks.image_folder import ImageFolderTask

    data = ImageFolderTask().load(root / site)
    images, labels = data.tensors("train", classes)
    (train_x, train_y), _ = train_val_split(images, labels, seed=derive_seed(seed, "split", site))
    return train_x, train_y


def train(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, lr: float, weight_decay: float,
          batch_size: int, generator: torch.Generator) -> float:
    """Train ``model`` in place; returns the last epoch's mean cross-entropy."""
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    loss_sum = 0.0
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=generator)
        loss_sum = 0.0
        for start in range(0, len(y), batch_size):
            idx = order[start:start + batch_size]
            loss = F.cross_entropy(model(x[idx].float().div_(255.0)), y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += float(loss.detach()) * len(idx)
    return loss_sum / len(y)


def main(argv=None) -> None:
    import nvflare.client as flare
    from nvflare.app_common.abstract.fl_model import FLModel

    from fedrelay.peer.training import derive_seed
    from fedrelay.tasks.image_folder.models import SmallCNN

    args = parse(argv)
    classes = args.classes.split(",")
    flare.init()
    site = flare.get_site_name()
    x, y = site_train_images(args.sites_root, site, classes, args.seed)
    generator = torch.Generator().manual_seed(derive_seed(args.seed, "flare", site))
    model = SmallCNN(int(x.shape[1]), (int(x.shape[2]), int(x.shape[3])), len(classes))
    while flare.is_running():
        received = flare.receive()
        if received is None:
            break
        started = time.monotonic()
        state = {k: torch.as_tensor(v) for k, v in received.params.items()}
        model.load_state_dict(state)
        epochs = args.epochs + (args.warmup_epochs if site == args.first_site else 0)
        loss = train(model, x, y, epochs, args.lr, args.weight_decay, args.batch_size, generator)
        sent = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        seconds = time.monotonic() - started
        with args.log.open("a") as f:
            f.write(json.dumps({"site": site, "round": received.current_round, "train_images": int(len(y)),
                                "epochs": epochs, "seconds": seconds, "train_loss": loss}) + "\n")
        flare.send(FLModel(params=sent, metrics={"train_loss": loss}))


if __name__ == "__main__":
    main()
