"""Text from other parties is data (``fedrelay/text.py``): a site's failure text, detail, device
name, refusal details or stop reason with rich markup, escape sequences (C0, 8-bit CSI/OSC),
bidi overrides or newlines is shown as text by every command (``coordinator show``, ``runs``,
``watch``, ``peers``, ``metrics``, ``start-chain``, ``peer status``, error messages), and the
daemons' log records stay one line each."""

from __future__ import annotations

import io
import logging
import re

import pytest
from conftest import image_offers
from rich.console import Console
from typer.testing import CliRunner

from fedrelay.server import make_server
from fedrelay.coordinator.ledger import Ledger
from fedrelay.coordinator.plan import chain_plan
from fedrelay.coordinator.service import CoordinatorService
from fedrelay.v1 import coordinator_pb2 as cpb, coordinator_pb2_grpc, peer_pb2, peer_pb2_grpc

# What a hostile site writes where free text is allowed: markup that closes nothing, an OSC that
# sets the terminal's title, an 8-bit CSI, a bidi override, and a line that looks like a log record.
HOSTILE = "[/]x[/bold] \x1b]0;pwned\x07 \x9b31m \u202eevil\n12:00:00 [coordinator] INFO run r ended: finished"
# What the intake allows in free text (no C0 control but tab and newline): markup, C1, bidi.
HOSTILE_TEXT = "[/]x[/bold] \x9b31m \u202eevil\n12:00:00 [coordinator] INFO run r ended: finished"
UNSAFE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2066-\u2069]")


def assert_shown_as_text(output: str) -> None:
    """Nothing a terminal acts on, the markup shown literally, no forged line."""
    assert not UNSAFE.search(output), repr(UNSAFE.search(output))
    assert "[/bold]" in output, output
    assert not any(line.lstrip().startswith("12:00:00") for line in output.splitlines()), output


# -- the helpers ---------------------------------------------------------------------------------------
def test_clean_and_safe_show_every_character_and_parse_none():
    from fedrelay.text import clean, safe, safe_tree

    assert clean("a\nb\r\x1b[2J\x9b\x9d\x7f\u202e\u2066\u200b\ufeff") == \
        "a\\nb\\r\\x1b[2J\\x9b\\x9d\\x7f\\u202e\\u2066\\u200b\\ufeff"
    assert clean("plain text, é, 日本") == "plain text, é, 日本"
    assert clean("x" * 50, max_chars=10) == "x" * 10 + "... (50 characters)"
    console = Console(file=io.StringIO(), width=300, force_terminal=False)
    for text in (HOSTILE, "a\\", "a\\\\", "[bold]", "\\[/]", "[link=http://x]y[/link]", ":x:"):
        console.print(f"[bold]{safe(text)}[/] end", highlight=False)
    shown = console.file.getvalue()
    assert "[/]x[/bold]" in shown and "[link=http://x]y[/link]" in shown and "\\u202eevil\\n12:00:00" in shown
    assert safe_tree({"k[/]": ["[/]", 1, None]}) == {"k\\[/]": ["\\[/]", 1, None]}


def test_log_records_are_one_line_each_whatever_the_message_holds(capsys):
    from fedrelay.cli.common import setup_logging

    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    root.handlers[:] = []
    try:
        setup_logging(False, prefix="[coordinator] ")
        log = logging.getLogger("fedrelay.test")
        log.info("run %s failed: %s", "r", HOSTILE)
        try:
            raise ValueError("bad\nforged: line \x1b[31m")
        except ValueError:
            log.exception("step failed: %s", "x\ny")
    finally:
        root.handlers[:] = saved
        root.setLevel(level)
    lines = capsys.readouterr().err.splitlines()
    starts = [line for line in lines if not line.startswith("    | ")]
    assert len(starts) == 2, lines  # two records, each one line; the traceback's lines indented
    assert "\\n12:00:00 [coordinator] INFO run r ended" in starts[0]
    assert not UNSAFE.search("\n".join(lines).replace("\n", "")), lines
    assert any("forged: line \\x1b[31m" in line for line in lines)


# -- the commands --------------------------------------------------------------------------------------
class Context:
    def abort(self, code, message):
        raise AssertionError((code, message))

    def auth_context(self):
        return {}

    def peer(self):
        return "ipv4:127.0.0.1:1"


@pytest.fixture(scope="module")
def coordinator():
    ledger = Ledger(":memory:")
    service = CoordinatorService(ledger)
    server, port = make_server("127.0.0.1:0")
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(service, server)
    server.start()
    # A running run whose site reported a hostile detail and a metric row with a hostile stage
    # (what a ledger written before the value checks may hold), and a warning.
    sites = ["site-a", "site-b"]
    for run_id in ("shown", "failing", "watched"):
        ledger.create_run(run_id, strategy="fedelmy", arch="cnn", seed=1, params={}, class_index=["x"], model={},
                          chain=[{"name": n, "address": "127.0.0.1:9"} for n in sites], warnings=[HOSTILE],
                          insecure=True, plan=chain_plan(sites).to_json())
    service.ReportProgress(cpb.ProgressReport(run_id="shown", site="site-a", kind="state", state="training",
                                              detail=HOSTILE_TEXT), Context())
    ledger.record_metric("shown", "site-a", HOSTILE, 1, 1, 1, 0.5, None, 1.0)
    service.ReportFailure(cpb.FailureReport(run_id="failing", site="site-b", error=HOSTILE_TEXT), Context())
    ledger.add_event("watched", "hop", HOSTILE, site="site-a")
    ledger.add_event("watched", "failed", HOSTILE, site="site-a")  # the live view stops at it
    ledger.upsert_peer("site-h", "127.0.0.1:9", image_offers({"c": (1, 1)}), HOSTILE, "x")
    yield f"127.0.0.1:{port}"
    server.stop(0)
    service.close()


def coordinator_cli(*args: str):
    from fedrelay.cli.coordinator import app

    return CliRunner().invoke(app, list(args), env={"COLUMNS": "400"})


@pytest.mark.parametrize("command", [["show", "shown"], ["show", "failing"], ["peers"],
                                     ["metrics", "shown"], ["watch", "watched"]])
def test_a_sites_words_are_shown_as_text_by_the_operators_commands(coordinator, command):
    result = coordinator_cli(*command, "--coordinator", coordinator, "--insecure")
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == (1 if command[0] == "watch" else 0), result.output
    assert_shown_as_text(result.output)


def test_an_error_message_quoting_a_value_is_shown_as_text(coordinator):
    result = coordinator_cli("show", "x[/]", "--coordinator", coordinator, "--insecure")
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 2
    assert "run_id must be" in result.output and "x[/]" in result.output


def test_start_chain_shows_the_coordinators_warnings_as_text(coordinator, monkeypatch):
    from fedrelay.coordinator.client import OperatorClient

    monkeypatch.setattr(OperatorClient, "start_chain", lambda self, **kw: cpb.StartChainReply(
        run_id="r-1", order=["site-a", "site-b"], warnings=[HOSTILE]))
    result = coordinator_cli("start-chain", "--seed", "1", "--coordinator", coordinator, "--insecure")
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 0
    assert_shown_as_text(result.output)


def test_peer_status_shows_its_daemons_words_as_text():
    from fedrelay.cli.peer import app

    class Servicer(peer_pb2_grpc.PeerServicer):
        def GetStatus(self, request, context):
            return peer_pb2.PeerStatus(name="site-x", address="127.0.0.1:1", device=HOSTILE, version="x",
                                       coordinator="127.0.0.1:2", registration_error=HOSTILE, last_registered=1.0,
                                       runs=[peer_pb2.RunStatus(run_id="r", state="[/]", detail=HOSTILE)])

    server, port = make_server("127.0.0.1:0")
    peer_pb2_grpc.add_PeerServicer_to_server(Servicer(), server)
    server.start()
    try:
        result = CliRunner().invoke(app, ["status", "--peer", f"127.0.0.1:{port}", "--insecure"],
                                    env={"COLUMNS": "400"})
    finally:
        server.stop(0)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 0, result.output
    assert_shown_as_text(result.output)
