"""``fedrelay new-task``: the package it writes installs with pip, passes its own tests and is
offered by a site as is; bad names and used folders are refused before anything is written."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedrelay.cli.fedrelay import app

pytestmark = pytest.mark.system

REPO = Path(__file__).resolve().parent.parent


def new_task(*args: str):
    return CliRunner().invoke(app, ["new-task", *args])


def test_fedrelay_is_a_console_script():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["fedrelay"] == "fedrelay.cli.fedrelay:app"


def write_csv_site(folder: Path) -> Path:
    """A site folder in the template's CSV format: 2 classes, 30 + 10 rows each."""
    folder.mkdir(parents=True)
    for split, n in (("train", 60), ("test", 20)):
        rows = ["potassium,sodium,label"] + [f"{4 + i % 2 + i / 100:.2f},{140 - i % 7},{('low', 'high')[i % 2]}"
                                             for i in range(n)]
        (folder / f"{split}.csv").write_text("\n".join(rows) + "\n")
    return folder


def test_the_package_installs_passes_its_tests_and_a_site_offers_it_as_is(tmp_path):
    from fedrelay import tasks

    res = new_task("lab-values", "--out", str(tmp_path / "lab-values"))
    assert res.exit_code == 0, res.output
    assert "lab_values" in res.output and "LabValuesTask" in res.output
    out = tmp_path / "lab-values"
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        "README.md", "lab_values/__init__.py", "pyproject.toml", "tests/test_lab_values.py"]
    project = tomllib.loads((out / "pyproject.toml").read_text())["project"]
    assert project["name"] == "lab-values" and project["dependencies"] == []
    assert project["entry-points"]["fedrelay.tasks"] == {"lab-values": "lab_values:LabValuesTask"}
    for path in out.rglob("*"):  # no trace of the template's names
        if path.is_file():
            text = path.read_text()
            assert not any(t in text for t in ("example-task", "example_task", "ExampleTask")), path
    # pip builds it (no network, no build isolation); what `pip install` would put in
    # site-packages goes to a folder on the site's path.
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                            "--no-cache-dir", "--quiet", "-w", str(tmp_path / "dist"), str(out)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = (tmp_path / "dist").glob("lab_values-0.1.0-py3-none-any.whl")
    lib = tmp_path / "lib"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(lib)
    digest = tasks.digest_of(lib / "lab_values")
    assert digest == tasks.digest_of(out / "lab_values")  # the same files, the same digest, wherever
    env = {**os.environ, "PYTHONPATH": str(lib)}
    # Its own tests pass, the installed entry point's included.
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(out)],
                           capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert tests.returncode == 0 and "5 passed" in tests.stdout, tests.stdout[-3000:] + tests.stderr[-2000:]
    # A site's daemon reads its folder with the task as is, and shows the code's digest.
    site = write_csv_site(tmp_path / "site-a")
    check = subprocess.run([str(Path(sys.executable).parent / "peer"), "serve", "--check", "--data", str(site),
                            "--name", "site-a", "--insecure", "--device", "cpu", "--task", "lab-values",
                            "--state-dir", str(tmp_path / "state")],
                           capture_output=True, text=True, timeout=300, env=env)
    assert check.returncode == 0, check.stderr
    line = " ".join(check.stdout.split())
    assert f"task lab-values 0.1.0 (code SHA-256 {digest}): 80 samples in 2 classes" in line, line


@pytest.mark.parametrize("name, package, cls", [
    ("lab-values", "lab_values", "LabValuesTask"),
    ("Chest.XRay-task", "chest_xray_task", "ChestXRayTask"),
    ("3d-ct", "task_3d_ct", "Task3dCt"),
    ("class", "class_task", "ClassTask"),
])
def test_the_python_names_come_from_the_task_name(name, package, cls):
    from fedrelay.tasks.scaffold import class_name, package_name

    assert (package_name(name), class_name(name)) == (package, cls)


def test_bad_names_and_used_folders_are_refused_and_nothing_is_written(tmp_path):
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("keep me")
    (tmp_path / "file").write_text("")
    for args, words in [
        (["lab-values", "--out", str(used)], "exists and is not empty"),
        (["lab-values", "--out", str(tmp_path / "file")], "is a file"),
        (["lab values!", "--out", str(tmp_path / "a")], "use letters, digits"),
        (["my_task:MyTask", "--out", str(tmp_path / "b")], "not module:attr"),
        (["_bad", "--out", str(tmp_path / "c")], "use letters, digits"),
        (["né", "--out", str(tmp_path / "d")], "ASCII"),
        (["image-folder", "--out", str(tmp_path / "e")], "built-in task"),
        (["json", "--out", str(tmp_path / "f")], "standard library"),
        (["fedrelay", "--out", str(tmp_path / "g")], "already importable"),
    ]:
        res = new_task(*args)
        assert res.exit_code != 0, (args, res.output)
        assert words in " ".join(res.output.split()) and "Traceback" not in res.output, (args, res.output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "used"]  # no folder, no staging left
    assert [p.name for p in used.iterdir()] == ["notes.txt"] and (used / "notes.txt").read_text() == "keep me"
    # An empty folder is fine.
    empty = tmp_path / "empty"
    empty.mkdir()
    res = new_task("lab-values", "--out", str(empty))
    assert res.exit_code == 0, res.output
    assert (empty / "lab_values" / "__init__.py").is_file()
