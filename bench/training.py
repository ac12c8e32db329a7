"""Study 4a, training speed (a single component: the peer's training code, no network).

On one site's data, in one process, with the same model, data, batch size and thread count:

- **plain loop**: a hand-written PyTorch loop (shuffle, forward, cross-entropy, backward, Adam
  step), the reference;
- **FedSeq**: ``fedrelay.peer.strategies.fedseq.train_fedseq`` (what a peer runs for ``--strategy
  fedseq``) with last-epoch selection (one validation pass, after the last epoch: like for like
  with the plain loop; this is ``fedseq_vs_plain_loop``) and with best-validation selection
  (a validation pass and a best-epoch copy after every epoch);
- **FedELMY pool only** (α = β = 0) and **FedELMY** (α = β = 1), S models via ``train_pool``.

Images per second count training images only (validation passes are overhead the plain loop
does not have). The regulariser's cost is FedELMY's time over pool-only's time, minus 1.

    python -m bench.training            # a real Fashion-MNIST site (demo split), S = 5, E = 2
    python -m bench.training --quick    # synthetic data, tiny (the test suite's smoke run)
    python -m bench.training --device cuda:0   # on a GPU: results section "training_cuda"

On a GPU every loop runs with the deterministic kernels a peer daemon uses by default
(``use_deterministic_kernels``; ``--no-deterministic`` for the faster, non-reproducible ones),
and each timing ends with ``torch.cuda.synchronize()``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench.common import record
from fedrelay.tasks import resolve as resolve_task


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def plain_loop(spec, train, epochs: int, batch_size: int, lr: float, weight_decay: float, seed: int,
               device: str = "cpu") -> float:
    """Seconds for ``epochs`` epochs of a textbook PyTorch training loop on ``device`` (the
    data moved there once, inside the timing, as the peer's training does)."""
    import torch
    from torch.nn import functional as F

    from fedrelay.models import build_model

    torch.manual_seed(seed)
    model = build_model(spec).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    g = torch.Generator().manual_seed(seed)
    started = time.perf_counter()
    x_all, y_all = train[0].to(device), train[1].to(device)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(y_all), generator=g).to(device)
        for i in range(0, len(order), batch_size):
            idx = order[i:i + batch_size]
            x = x_all[idx].float().div_(255)
            loss = F.cross_entropy(model(x), y_all[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    _sync(device)
    return time.perf_counter() - started


def site_data(quick: bool, sites_dir: Path | None):
    import torch

    from fedrelay.peer.training import train_val_split
    from fedrelay.tasks.image_folder.data import load_site

    if quick or sites_dir is None or not (sites_dir / "site-00").exists():
        g = torch.Generator().manual_seed(0)
        n = 512 if quick else 6000
        y = torch.randint(0, 10, (n,), generator=g)
        x = torch.randint(0, 60, (n, 1, 28, 28), generator=g, dtype=torch.uint8)
        for i in range(n):
            r, c = divmod(int(y[i]), 4)
            x[i, 0, r * 9:r * 9 + 7, c * 6:c * 6 + 7] = 220
        return train_val_split(x, y, seed=0), "synthetic"
    site = load_site(sites_dir / "site-00")
    classes = sorted(site.class_names)
    x, y = site.tensors("train", classes)
    return train_val_split(x, y, seed=0), str(sites_dir / "site-00")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description="Training speed against a plain PyTorch loop (bench study 4a)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sites", type=Path, default=Path("demo/sites"), help="split made by make demo")
    ap.add_argument("--models-per-site", "-S", type=int, default=5)
    ap.add_argument("--local-epochs", "-E", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; each loop keeps its fastest")
    ap.add_argument("--results", type=Path, default=None)
    ap.add_argument("--device", default="cpu", help="cpu | cuda:N (a GPU run is recorded as 'training_cuda')")
    ap.add_argument("--no-deterministic", action="store_true", help="GPU: the default, non-deterministic kernels")
    args = ap.parse_args(argv)

    import torch

    from fedrelay.models import build_model

    from fedrelay.tasks.image_folder import spec as image_spec
    from fedrelay.peer.strategies.fedelmy import train_pool
    from fedrelay.peer.strategies.fedseq import train_fedseq
    from fedrelay.peer.training import TrainConfig, use_deterministic_kernels

    device = args.device
    deterministic = device.startswith("cuda") and not args.no_deterministic
    if deterministic:
        use_deterministic_kernels(device)  # as a peer daemon does on a GPU

    S, E = (2, 1) if args.quick else (args.models_per_site, args.local_epochs)
    (train, val), source = site_data(args.quick, args.sites)
    n_train = len(train[1])
    spec = image_spec("cnn", 1, (28, 28), 10)
    base = dict(models_per_site=S, local_epochs=E, warmup_epochs=0, lr=1e-3, batch_size=128, weight_decay=1e-4)
    torch.manual_seed(1)
    m0 = build_model(spec).state_dict()
    images = S * E * n_train

    def timed(fn):
        t = time.perf_counter()
        fn()
        _sync(device)
        return time.perf_counter() - t

    plain_loop(spec, (train[0][:1024], train[1][:1024]), 1, 128, 1e-3, 1e-4, seed=1, device=device)  # warm-up
    # Rounds interleave the four loops, and each keeps its fastest round, so that load from
    # other processes on a shared machine hurts every loop alike instead of one of them.
    runs = {
        "plain_loop": lambda: plain_loop(spec, train, S * E, 128, 1e-3, 1e-4, seed=1, device=device),
        "fedseq": lambda: timed(lambda: train_fedseq(m0, spec, train, val, TrainConfig(
            strategy="fedseq", selection="last-epoch", **base), 1, device)),
        "fedseq_best_val": lambda: timed(lambda: train_fedseq(m0, spec, train, val, TrainConfig(
            strategy="fedseq", selection="best-val", **base), 1, device)),
        "fedelmy_pool_only": lambda: timed(lambda: train_pool(m0, spec, train, val,
                                                              TrainConfig(alpha=0.0, beta=0.0, **base), 1, device)),
        "fedelmy": lambda: timed(lambda: train_pool(m0, spec, train, val, TrainConfig(alpha=1.0, beta=1.0, **base),
                                                    1, device)),
    }
    best = {k: float("inf") for k in runs}
    for _ in range(1 if args.quick else args.rounds):
        for k, fn in runs.items():
            best[k] = min(best[k], fn())
    t_plain, t_fedseq, t_pool, t_elmy = best["plain_loop"], best["fedseq"], best["fedelmy_pool_only"], best["fedelmy"]
    t_best_val = best["fedseq_best_val"]
    # The validation passes (10% of the site, once per epoch) are part of a peer's cost; report
    # them separately so that the loop itself is compared like for like.
    from fedrelay.peer.training import evaluate

    model = build_model(spec).to(device)
    t_val = timed(lambda: [evaluate(model, *val, device=device, task=resolve_task(spec)) for _ in range(S * E)])
    seconds = {"plain_loop": t_plain, "fedseq": t_fedseq, "fedseq_best_val": t_best_val,
               "fedelmy_pool_only": t_pool, "fedelmy": t_elmy}
    ips = {k: images / t for k, t in seconds.items()}
    figures = {
        "source": source, "train_images": n_train, "S": S, "E": E, "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
        "deterministic_kernels": deterministic,
        "seconds": {**seconds, "validation_passes": t_val},
        "images_per_second": ips,
        "fedseq_vs_plain_loop": t_plain / t_fedseq,
        "fedseq_best_val_vs_plain_loop": t_plain / t_best_val,
        "fedseq_best_val_vs_plain_loop_excluding_validation": t_plain / max(1e-9, t_best_val - t_val),
        "fedelmy_regulariser_overhead": t_elmy / t_pool - 1.0,
        "quick": args.quick,
        "rounds": 1 if args.quick else args.rounds,
        "summary": f"{S} x {E} epochs over {n_train} training images ({source}), small CNN, batch 128, "
                   f"fastest of {1 if args.quick else args.rounds} interleaved rounds per loop, "
                   + (f"on {torch.cuda.get_device_name(device)} ("
                      + ("deterministic" if deterministic else "default, non-deterministic") + " kernels). "
                      if device.startswith("cuda") else f"{torch.get_num_threads()} threads. ")
                   + "Targets: FedSeq >= 0.95x the plain loop; FedELMY's regulariser <= 10% extra time.",
        "tables": [{"title": "training throughput (same model, data, batch, threads)",
                    "columns": ["loop", "seconds", "train images/s"],
                    "rows": [[k, round(v, 2), round(ips[k], 0)] for k, v in seconds.items()]}],
        "notes": [f"FedSeq (last-epoch selection) / plain loop speed: {t_plain / t_fedseq:.3f} (target >= 0.95)",
                  f"FedSeq (best-validation selection) / plain loop speed: {t_plain / t_best_val:.3f}, with a "
                  f"validation pass after each of its {S * E} epochs ({t_val:.2f} s in all); without those passes: "
                  f"{t_plain / max(1e-9, t_best_val - t_val):.3f}",
                  f"FedELMY regulariser overhead over pool-only: {100 * (t_elmy / t_pool - 1):.1f}%"],
    }
    for k, v in figures["seconds"].items():
        print(f"{k}: {v:.2f} s" + (f" ({ips[k]:.0f} img/s)" if k in ips else ""), flush=True)
    print(f"fedseq vs plain loop: {figures['fedseq_vs_plain_loop']:.3f}; regulariser overhead "
          f"{100 * figures['fedelmy_regulariser_overhead']:.1f}%")
    kw = {"results": args.results} if args.results else {}
    record("training" if device == "cpu" else "training_cuda", figures, **kw)
    return figures


if __name__ == "__main__":
    main()
