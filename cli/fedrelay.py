"""``fedrelay``: tools for the people who write a federation's tasks (``fedrelay new-task``)."""

from __future__ import annotations

from pathlib import Path

import typer

from fedrelay.cli import exits
from fedrelay.cli.common import console, fail, json_option, make_app, version_option

app = make_app("fedrelay: write and check the task (model, data, metrics) a federation runs.",
               env_prefix="FEDRELAY")


@app.callback()
def main(version: bool = version_option()) -> None:
    """fedrelay: write and check the task (model, data, metrics) a federation runs."""


@app.command("new-task")
def new_task(
    name: str = typer.Argument(..., metavar="NAME", help="The task's name: what sites register and `coordinator start-chain --task` "
                               "takes (ASCII letters, digits, '-', '_', '.'), e.g. lab-values."),
    out: Path = typer.Option(None, "--out", "-o", help="The package's folder; must not exist or be empty "
                             "\\[default: ./NAME]."),
    as_json: bool = json_option('Print {"name", "out", "package", "class"} as JSON.'),
) -> None:
    """Write a task package NAME that sites pip-install and run as is; adapt it to your data and model.

    The package holds a loader of a documented CSV format, a small model, a metric of its own, tests and a README.
    """
    from fedrelay.tasks.scaffold import new_task as write

    try:
        made = write(name, out)
    except ValueError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot write {out or name}: {exc}", exits.FAILED)
    where = made.out
    if as_json:
        import json

        print(json.dumps({"name": made.name, "out": str(where), "package": made.package, "class": made.cls}))
        return
    console.print(f"wrote the task package [bold]{made.name}[/] in {where} (Python package {made.package}, "
                  f"class {made.cls})", highlight=False, soft_wrap=True)
    console.print(f"next:\n"
                  f"  1. adapt {made.module_file} (the loader, the model, the metrics; {where / 'README.md'} "
                  f"says how)\n"
                  f"  2. python -m pytest {where}\n"
                  f"  3. at every site, in fedrelay's environment: pip install {where}\n"
                  f"     then: peer serve --check --data SITE_FOLDER --name SITE ...   (shows the task's code "
                  f"SHA-256)\n"
                  f"  4. coordinator start-chain --task {made.name} ...", highlight=False, markup=False, soft_wrap=True)


if __name__ == "__main__":
    app()
