"""MkDocs hook: the pages of the documentation that are generated from the code at build time.

Listed under ``hooks:`` in ``mkdocs.yml``; nothing here is typed in by hand:

- ``reference/cli.md``: every command and option of the ``coordinator``, ``peer`` and ``fedrelay``
  typer apps (``fedrelay/cli/*.py``), read through click's own objects;
- ``reference/ledger.md``: the coordinator's SQLite ledger, from ``coordinator/ledger.py``'s
  ``SCHEMA`` (applied to an in-memory database; the comments are the SQL's own);
- ``reference/protocol.md``: the gRPC services and messages of ``proto/fedrelay/v1/*.proto``,
  compiled with protoc (grpcio-tools) keeping the source comments;
- ``reference/modules.md``: every module of the repository's Python folders, folder by folder,
  with the first sentence of its docstring (read with ``ast``, nothing imported);
- ``explanation/benchmark-results.md``: every study's figures from ``bench/results.json`` (the
  same rendering as ``bench/RESULTS.md``), with its plots.

and, on every page, ``{{bench PATH [FORMAT]}}`` is replaced with the value at PATH (dot-separated
keys, list indices as numbers) of ``bench/results.json``, formatted with the Python format spec
FORMAT (e.g. ``{{bench chain.communication.model_bytes ,}}`` -> ``829,992``), optionally
scaled first (``{{bench accuracy.dir0_1.fedelmy_minus_fedseq *100 +.1f}}`` -> ``+5.4``). An unknown path
fails the build, so a figure cannot go stale silently; ``\\{{bench`` shows the syntax itself.
"""

from __future__ import annotations

import json
import re
import sqlite3
import tempfile
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results.json"
BENCH_TOKEN = re.compile(r"(?<!\\)\{\{bench ([A-Za-z0-9_.\-]+)(?: ([^}]*))?\}\}")

GENERATED = "<!-- generated at build time by docs/_hooks/generate.py; do not edit -->\n\n"


def _page(title: str, intro: str) -> list[str]:
    """A generated page's first lines: its ``# title``, the do-not-edit mark and its introduction
    (one paragraph)."""
    return [f"# {title}", "", GENERATED.strip(), "", intro, ""]


# -- figures from bench/results.json -------------------------------------------------------------

def _results() -> dict:
    return json.loads(RESULTS.read_text())


def bench_value(path: str, data: dict | None = None):
    """The value at ``path`` (``chain.accuracy.fedelmy``; a number is a list index) of
    results.json. Raises ``KeyError`` naming the path when it is not there."""
    value = _results() if data is None else data
    for part in path.split("."):
        try:
            value = value[int(part)] if isinstance(value, list) else value[part]
        except (KeyError, IndexError, ValueError) as exc:
            raise KeyError(f"bench/results.json has no {path!r} (at {part!r})") from exc
    return value


def substitute_bench(markdown: str, data: dict | None = None) -> str:
    """Replace every ``{{bench PATH [FORMAT]}}`` in ``markdown``."""
    data = _results() if data is None else data

    def one(m: re.Match) -> str:
        value = bench_value(m.group(1), data)
        spec = (m.group(2) or "").strip()
        if spec.startswith("*"):  # "*100 +.1f": scale first (a fraction shown in points)
            factor, _, spec = spec[1:].partition(" ")
            value = value * float(factor)
        return format(value, spec) if spec else str(value)

    return BENCH_TOKEN.sub(one, markdown).replace("\\{{bench", "{{bench")  # \{{bench: shown as written


# -- the CLI reference ---------------------------------------------------------------------------

APPS = (("coordinator", "fedrelay.cli.coordinator"), ("peer", "fedrelay.cli.peer"),
        ("fedrelay", "fedrelay.cli.fedrelay"))


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _param_type(param) -> str:
    """The parameter's type in words: its choices, ``flag``, or the annotation's type name."""
    import enum
    import typing

    if getattr(param, "is_flag", False):
        return "flag"
    t = getattr(param, "type", None)  # a click ParamType (typer versions that expose one)
    if getattr(t, "choices", None):
        return " \\| ".join(f"`{c}`" for c in t.choices)
    ann = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    if ann is None:
        return getattr(t, "name", "") or ""
    args = [a for a in typing.get_args(ann) if a is not type(None)]
    if typing.get_origin(ann) is typing.Literal:
        return " \\| ".join(f"`{c}`" for c in typing.get_args(ann))
    if typing.get_origin(ann) in (typing.Union, getattr(__import__("types"), "UnionType", None)) and len(args) == 1:
        ann = args[0]
    if typing.get_origin(ann) in (list, tuple):
        inner = typing.get_args(ann)[0] if typing.get_args(ann) else str
        return f"{getattr(inner, '__name__', str(inner))}, repeatable"
    if isinstance(ann, type) and issubclass(ann, enum.Enum):
        return " \\| ".join(f"`{m.value}`" for m in ann)
    return {"str": "text", "Path": "path", "int": "integer", "float": "number", "bool": "flag"}.get(
        getattr(ann, "__name__", ""), getattr(ann, "__name__", str(ann)))


def _param_default(param) -> str:
    if getattr(param, "is_flag", False) and not param.default:
        return ""
    d = param.default
    if d is None or d == "" or d == () or callable(d):
        return ""
    if "Sentinel" in type(d).__name__ or repr(d).startswith("<"):  # click's UNSET
        return ""
    return f"`{d}`"


def cli_markdown() -> str:
    """Every command of the three typer apps with its options, as Markdown."""
    import importlib

    import typer.main

    # typer vendors its own click: its objects are recognised by what they have, not by class.
    def is_option(p):
        return p.param_type_name == "option" and not getattr(p, "hidden", False)

    def is_argument(p):
        return p.param_type_name == "argument"

    lines = _page("Command-line reference",
                  "Generated from the typer apps themselves (`fedrelay/cli/`): every command, argument and "
                  "option, its type or choices, its default and its help text, exactly as `--help` has them.")
    for prog, module in APPS:
        app = importlib.import_module(module).app
        group = typer.main.get_command(app)
        lines += [f"## `{prog}`", "", _cell(group.help or ""), ""]
        if hasattr(group, "commands"):
            cmds = [(name, group.commands[name]) for name in sorted(group.commands)]
        else:
            cmds = [("", group)]
        top_opts = [p for p in group.params if is_option(p)]
        if hasattr(group, "commands") and top_opts:
            lines += [f"Options of `{prog}` itself: "
                      + ", ".join(f"`{' / '.join(p.opts + p.secondary_opts)}`" for p in top_opts), ""]
        for name, cmd in cmds:
            if getattr(cmd, "hidden", False):
                continue
            full = f"{prog} {name}".strip()
            usage = " ".join(["[OPTIONS]"] + [(p.metavar or p.name.upper()) if p.required else
                                              f"[{p.metavar or p.name.upper()}]"
                                              for p in cmd.params if is_argument(p)])
            lines += [f"### `{full}`", "", f"    {full} {usage}", ""]
            if cmd.help:
                lines += [" ".join(cmd.help.split()), ""]
            args = [p for p in cmd.params if is_argument(p)]
            opts = [p for p in cmd.params if is_option(p)]
            if args:
                lines += ["| argument | type | required | help |", "|---|---|---|---|"]
                for p in args:
                    lines.append(f"| `{(p.metavar or p.name.upper())}` | {_param_type(p)} | {'yes' if p.required else 'no'} "
                                 f"| {_cell(getattr(p, 'help', '') or '')} |")
                lines.append("")
            if opts:
                lines += ["| option | type | default | environment | help |", "|---|---|---|---|---|"]
                for p in opts:
                    names = " / ".join(f"`{o}`" for o in p.opts + p.secondary_opts)
                    env = p.envvar if isinstance(p.envvar, str) else ", ".join(p.envvar or ())
                    req = " (required)" if p.required else ""
                    lines.append(f"| {names}{req} | {_param_type(p)} | {_param_default(p)} | "
                                 f"{f'`{env}`' if env else ''} | {_cell(p.help or '')} |")
                lines.append("")
    return "\n".join(lines) + "\n"


# -- the ledger schema ---------------------------------------------------------------------------

def ledger_markdown() -> str:
    """Every table of the coordinator's ledger: its columns (type, NOT NULL, default, key) and the
    SQL's own comments, from ``coordinator/ledger.py``'s ``SCHEMA``."""
    from fedrelay.coordinator.ledger import SCHEMA

    db = sqlite3.connect(":memory:")
    db.executescript(SCHEMA)
    comments: dict[tuple[str, str], str] = {}
    table_notes: dict[str, str] = {}
    table = None
    for line in SCHEMA.splitlines():
        m = re.match(r"\s*CREATE TABLE IF NOT EXISTS (\w+) \((?:\s*--\s*(.*))?", line)
        if m:
            table = m.group(1)
            if m.group(2):
                table_notes[table] = m.group(2).strip()
            continue
        if table and "--" in line:
            code, note = line.split("--", 1)
            cols = re.findall(r"(?:^|,)\s*(\w+)\s+(?:TEXT|INTEGER|REAL|BLOB)", code)
            for col in cols:
                comments[(table, col)] = note.strip()
    lines = _page("Ledger schema",
                  "The coordinator keeps its only state in one SQLite file (`coordinator serve --db`). "
                  "These are its tables, generated from `coordinator/ledger.py` (`SCHEMA`); the notes are "
                  "the schema's own comments. Times are unix seconds (REAL). `coordinator audit` opens "
                  "the file read-only; see [Read the ledger and audit a run](../how-to/ledger-and-audit.md).")
    tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table' "
                                       "AND name NOT LIKE 'sqlite_%' ORDER BY rowid")]
    for t in tables:
        lines += [f"## `{t}`", ""]
        if t in table_notes:
            lines += [table_notes[t][0].upper() + table_notes[t][1:] + ".", ""]
        lines += ["| column | type | not null | default | key | note |", "|---|---|---|---|---|---|"]
        for _cid, name, ctype, notnull, default, pk in db.execute(f"PRAGMA table_info({t})"):
            lines.append(f"| `{name}` | {ctype} | {'yes' if notnull else ''} | "
                         f"{_cell(default) if default is not None else ''} | {pk or ''} | "
                         f"{_cell(comments.get((t, name), ''))} |")
        idx = [r for r in db.execute(f"SELECT name, sql FROM sqlite_master WHERE type='index' AND tbl_name=?", (t,))
               if r[1]]
        if idx:
            lines += [""] + [f"Index `{n}`: `{' '.join(sql.split())}`" for n, sql in idx]
        lines.append("")
    return "\n".join(lines) + "\n"


# -- the wire protocol ---------------------------------------------------------------------------

_LABELS = {1: "optional", 2: "required", 3: "repeated"}


def _proto_set():
    """protoc's FileDescriptorSet of proto/fedrelay/v1/*.proto, with source comments."""
    import grpc_tools
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    proto_dir = ROOT / "proto"
    protos = sorted(str(p.relative_to(proto_dir)) for p in (proto_dir / "fedrelay" / "v1").glob("*.proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        if protoc.main(["protoc", f"-I{proto_dir}", f"-I{include}", "--include_source_info",
                        f"--descriptor_set_out={out}", *protos]) != 0:
            raise RuntimeError("protoc failed on proto/fedrelay/v1")
        fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    return fds


def _comments(fd) -> dict[tuple, str]:
    found = {}
    for loc in fd.source_code_info.location:
        text = " ".join((loc.leading_comments + " " + loc.trailing_comments).split())
        if text:
            found[tuple(loc.path)] = text
    return found


def _type_name(field, maps: dict | None = None) -> str:
    from google.protobuf import descriptor_pb2 as d

    if maps and field.type_name in maps:
        key, value = maps[field.type_name]
        return f"map<{_type_name(key)}, {_type_name(value)}>"
    if field.type in (d.FieldDescriptorProto.TYPE_MESSAGE, d.FieldDescriptorProto.TYPE_ENUM):
        name = field.type_name.rsplit(".", 1)[-1]
        return f"[{name}](#{name.lower()})"
    return d.FieldDescriptorProto.Type.Name(field.type)[5:].lower()


def protocol_markdown() -> str:
    """Services, methods, messages, fields and enums of the wire contract, with the .proto comments."""
    fds = _proto_set()
    lines = _page("Wire protocol",
                  "fedrelay's daemons speak gRPC (protobuf, package `fedrelay.v1`), over mutual TLS unless "
                  "`--insecure`. Generated from `proto/fedrelay/v1/*.proto` (the comments are the files' "
                  "own); `make proto` regenerates the Python stubs in `fedrelay/v1/`. Models travel as "
                  "safetensors payloads in 1 MiB `ModelChunk`s, never as pickles.")
    for fd in sorted(fds.file, key=lambda f: f.name):
        if not fd.name.startswith("fedrelay/"):
            continue
        notes = _comments(fd)
        lines += [f"## `{fd.name}`", ""]
        for si, svc in enumerate(fd.service):
            lines += [f"### service `{svc.name}`", ""]
            if notes.get((6, si)):
                lines += [notes[(6, si)], ""]
            lines += ["| method | request | reply | what it does |", "|---|---|---|---|"]
            for mi, m in enumerate(svc.method):
                req = ("stream " if m.client_streaming else "") + _link(m.input_type)
                rep = ("stream " if m.server_streaming else "") + _link(m.output_type)
                lines.append(f"| `{m.name}` | {req} | {rep} | {_cell(notes.get((6, si, 2, mi), ''))} |")
            lines.append("")
        for ei, enum in enumerate(fd.enum_type):
            lines += _enum_lines(enum, notes, (5, ei))
        for mi, msg in enumerate(fd.message_type):
            lines += _message_lines(msg, notes, (4, mi))
    return "\n".join(lines) + "\n"


def _link(type_name: str) -> str:
    name = type_name.rsplit(".", 1)[-1]
    return f"[{name}](#{name.lower()})"


def _enum_lines(enum, notes, path) -> list[str]:
    out = [f"### {enum.name}", "", "enum" + (f": {notes[path]}" if notes.get(path) else ""), "",
           "| value | number | note |", "|---|---|---|"]
    for vi, v in enumerate(enum.value):
        out.append(f"| `{v.name}` | {v.number} | {_cell(notes.get(path + (2, vi), ''))} |")
    return out + [""]


def _message_lines(msg, notes, path, prefix: str = "fedrelay.v1") -> list[str]:
    out = [f"### {msg.name}", ""]
    if notes.get(path):
        out += [notes[path], ""]
    maps = {f".{prefix}.{msg.name}.{n.name}": (n.field[0], n.field[1])
            for n in msg.nested_type if n.options.map_entry}
    if msg.field:
        out += ["| field | number | type | note |", "|---|---|---|---|"]
        for fi, f in enumerate(msg.field):
            label = "repeated " if f.label == 3 and f.type_name not in maps else ""
            out.append(f"| `{f.name}` | {f.number} | {label}{_type_name(f, maps)} | {_cell(notes.get(path + (2, fi), ''))} |")
    else:
        out.append("(no fields)")
    out.append("")
    for ni, nested in enumerate(msg.nested_type):
        if nested.options.map_entry:
            continue
        out += _message_lines(nested, notes, path + (3, ni), f"{prefix}.{msg.name}")
    for ei, enum in enumerate(msg.enum_type):
        out += _enum_lines(enum, notes, path + (4, ei))
    return out


# -- benchmark results ---------------------------------------------------------------------------

def benchmarks_markdown() -> str:
    """Every study's figures from bench/results.json, rendered as bench/RESULTS.md is."""
    import sys

    sys.path.insert(0, str(ROOT))
    try:
        from bench.common import sections_markdown
    finally:
        sys.path.remove(str(ROOT))
    data = _results()
    lines = _page("Benchmark results",
                  "Every figure on this page is read from `bench/results.json` when the site is built "
                  "(the studies of `bench/` write it; see [Benchmarks](benchmarks.md)). Timings move by "
                  "about ±25% between runs on shared 2-core machines; each comparison is against a "
                  "reference measured in the same run.")
    lines += sections_markdown(data)
    text = "\n".join(lines) + "\n"
    return text.replace("](plots/", "](bench-plots/")


# -- the module map ------------------------------------------------------------------------------

# Folder -> what it installs as (pyproject.toml's package-dir) and what it holds.
MODULE_FOLDERS = (
    ("fedrelay", "fedrelay", "the shared core: the task interface, the built-in tasks, what both daemons use"),
    ("peer", "fedrelay.peer", "the site daemon"),
    ("coordinator", "fedrelay.coordinator", "the coordinator"),
    ("cli", "fedrelay.cli", "the typer apps behind the commands"),
    ("deploy", "deploy", "trials on one machine and on several hosts (not installed)"),
    ("bench", "bench", "the benchmark studies (not installed)"),
)


def _first_sentence(doc: str | None) -> str:
    """A docstring's first sentence, on one line, reST literals as Markdown code."""
    if not doc:
        return ""
    para = " ".join(doc.strip().split("\n\n")[0].split())
    m = re.search(r"(?<!e\.g)(?<!i\.e)(?<!\bvs)\.(\s|$)", para)
    return (para[:m.start() + 1] if m else para).replace("``", "`")


def modules_markdown() -> str:
    """Each folder's modules (generated stubs left out) with the first sentence of their docstrings."""
    import ast

    lines = _page("Module map",
                  "Where each concept lives: every module of the repository's Python folders with the first "
                  "sentence of its docstring, read from the source when the site is built. "
                  "`tests/test_layout.py` checks the layering: the shared core imports neither daemon, "
                  "the daemons import only the shared core and themselves, and no import circle.")
    for folder, package, what in MODULE_FOLDERS:
        lines += [f"## `{folder}/`: {what}", "", f"Installs as `{package}`." if package != folder or folder == "fedrelay"
                  else "", "", "| module | what it owns |", "|---|---|"]
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder)
            if rel.parts[0] in ("v1", "_hooks") or "template" in rel.parts or path.name.startswith("test_"):
                continue
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
            if path.name == "__init__.py" and not doc:
                continue
            lines.append(f"| `{folder}/{rel.as_posix()}` | {_cell(_first_sentence(doc))} |")
        lines.append("")
    return "\n".join(lines) + "\n"


# -- MkDocs events -------------------------------------------------------------------------------

PAGES = {
    "reference/cli.md": cli_markdown,
    "reference/ledger.md": ledger_markdown,
    "reference/protocol.md": protocol_markdown,
    "reference/modules.md": modules_markdown,
    "explanation/benchmark-results.md": benchmarks_markdown,
}


def on_files(files: Files, config) -> Files:
    for uri, make in PAGES.items():
        files.append(File.generated(config, uri, content=make()))
    for plot in sorted((ROOT / "bench" / "plots").glob("*.png")):
        files.append(File.generated(config, f"explanation/bench-plots/{plot.name}", abs_src_path=str(plot)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    return substitute_bench(markdown)


_SPHINX_ROLE = re.compile(r":(?:meth|class|func|attr|mod|data|exc|obj|ref):\s*(?=<code)")


def on_page_content(html: str, page, config, files) -> str:
    # Docstrings name code with Sphinx roles (:class:`Task`); mkdocstrings renders the name as
    # code and leaves the role's text: drop it.
    return _SPHINX_ROLE.sub("", html)
