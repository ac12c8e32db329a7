"""The documentation site builds with warnings as errors, and its generated pages hold what the
code holds (every CLI command, every ledger table, every gRPC method, figures from results.json)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent

MISSING = [name for name, module in (("mkdocs", "mkdocs"), ("mkdocs-material", "material"),
                                      ("mkdocstrings[python]", "mkdocstrings_handlers"))
           if importlib.util.find_spec(module) is None]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    if MISSING:
        pytest.skip(f"{', '.join(MISSING)} not installed (pip install -e '.[dev]'): the site cannot be built")
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def _text(path: Path) -> str:
    return re.sub(r"<[^>]+>", "", path.read_text())


def test_every_cli_command_is_in_the_reference(site):
    import typer.main

    from fedrelay.cli import coordinator, fedrelay, peer

    page = _text(site / "reference" / "cli" / "index.html")
    for prog, app in (("coordinator", coordinator.app), ("peer", peer.app), ("fedrelay", fedrelay.app)):
        group = typer.main.get_command(app)
        for name, cmd in group.commands.items():
            if cmd.hidden:
                continue
            assert f"{prog} {name}" in page, f"{prog} {name} missing from the CLI reference"
            for p in cmd.params:
                if p.param_type_name == "option" and not p.hidden:
                    assert p.opts[0] in page


def test_ledger_and_protocol_pages_are_generated(site):
    from fedrelay.coordinator.ledger import SCHEMA

    ledger = _text(site / "reference" / "ledger" / "index.html")
    for table in re.findall(r"CREATE TABLE IF NOT EXISTS (\w+)", SCHEMA):
        assert table in ledger
    protocol = _text(site / "reference" / "protocol" / "index.html")
    for proto in (ROOT / "proto" / "fedrelay" / "v1").glob("*.proto"):
        for method in re.findall(r"rpc (\w+)\(", proto.read_text()):
            assert method in protocol, f"{method} of {proto.name} missing from the protocol page"


def test_figures_come_from_results_json(site):
    results = json.loads((ROOT / "bench" / "results.json").read_text())
    demo = results["scale"]["chains"]["rows"][0]
    quickstart = _text(site / "quickstart" / "index.html")
    assert demo["final_sha256"] in quickstart
    assert f"{demo['model_bytes']:,}" in quickstart
    assert "{{bench" not in quickstart
    for page in site.rglob("*.html"):
        assert not re.search(r"\{\{bench [a-z_]+\.", page.read_text()), f"an unreplaced figure in {page}"


def test_unknown_figure_fails_the_build():
    if MISSING:
        pytest.skip(f"{', '.join(MISSING)} not installed: the hook imports mkdocs")
    sys.path.insert(0, str(ROOT / "docs" / "_hooks"))
    try:
        import generate
    finally:
        sys.path.pop(0)
    data = {"chain": {"model_bytes": 829992, "rows": [{"x": 0.12345}]}}
    assert generate.substitute_bench("M = {{bench chain.model_bytes ,}}", data) == "M = 829,992"
    assert generate.substitute_bench("{{bench chain.rows.0.x *100 .1f}} points", data) == "12.3 points"
    assert generate.substitute_bench("\\{{bench PATH}}", data) == "{{bench PATH}}"
    with pytest.raises(KeyError, match="chain.nothing"):
        generate.substitute_bench("{{bench chain.nothing}}", data)


def test_readme_is_short_and_its_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 160, "README.md grows again: its content belongs in docs/"
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"
