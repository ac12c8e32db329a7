"""``split-dataset``: site folders for a trial, from a public data set (fedrelay/datasets/)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from fedrelay.cli import exits
from fedrelay.cli.common import console, fail, json_option


def split_dataset(
    name: str = typer.Argument(..., help="Dataset: fashion-mnist (image folders) | breast-cancer (tabular-csv "
                               "folders from scikit-learn's Wisconsin Diagnostic Breast Cancer data; no download)."),
    sites: int = typer.Option(10, "--sites", min=1, help="N: number of sites (>= 1)."),
    dirichlet: float = typer.Option(None, "--dirichlet", help="Dirichlet concentration of the label skew "
                                    "\\[default: 0.5 for fashion-mnist; none for breast-cancer: every site gets "
                                    "the overall mix of diagnoses]."),
    seed: int = typer.Option(0, "--seed", help="Fixes the Dirichlet draws, the shares and the subsampling."),
    out: Path = typer.Option(..., "--out", "-o", help="Folder for site-00 ... site-(N-1)."),
    source: Path = typer.Option(None, "--source", help="fashion-mnist: folder with the IDX files \\[default: "
                                "Debian's dataset-fashion-mnist]."),
    max_train_per_site: int = typer.Option(None, "--max-train-per-site", help="fashion-mnist: subsample each "
                                           "site's train images."),
    as_json: bool = json_option("Print the split's summary (per site: samples per class) as JSON."),
) -> None:
    """Write N site folders for a trial: label-skewed image folders (fashion-mnist), or hospitals'
    train.csv/test.csv tables (breast-cancer, for --task tabular-csv)."""
    import math

    from fedrelay.datasets.split import DatasetNotFound, split_dataset as do_split

    if dirichlet is not None and not (math.isfinite(dirichlet) and dirichlet > 0):
        fail(f"--dirichlet must be a finite number > 0 (the concentration of the label skew), got {dirichlet:g}")
    if max_train_per_site is not None and max_train_per_site < 1:
        fail(f"--max-train-per-site must be at least 1, got {max_train_per_site}")
    try:
        summary = do_split(name, sites=sites, dirichlet=dirichlet, seed=seed, out=out, source=source,
                           max_train_per_site=max_train_per_site)
    except DatasetNotFound as exc:
        fail(str(exc), exits.USAGE)
    except ValueError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(str(exc), exits.FAILED)
    if as_json:
        print(json.dumps({"sites": sites, "out": str(out), **summary}, indent=1, default=str))
        return
    console.print(f"wrote {sites} sites under {out}", highlight=False)
    if summary.get("name") == "breast-cancer":
        for s in summary["per_site"]:
            train, test = (", ".join(f"{c} {n}" for c, n in s[split].items()) for split in ("train", "test"))
            console.print(f"  {s['site']}: train {s['n_train']} ({train}), test {s['n_test']} ({test})",
                          highlight=False, soft_wrap=True)
        console.print("train on them with start-chain --task tabular-csv (each folder's fedrelay.toml names the "
                      "label column)", highlight=False, soft_wrap=True)
