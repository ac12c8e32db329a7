"""Text that other parties wrote, made safe for a terminal and for one log line.

A site controls many strings the coordinator and the CLI print: a failure's error, a state's
detail, a device name, a refusal's details, a stop reason, and everything a site's daemon
reports about itself. Such text is data, never markup or control:

- :func:`clean` replaces every character that a terminal or log reader would act on instead of
  showing with its escape (``\\x1b``, ``\\n``, ``\\u202e``): C0 controls (ESC, CR, LF, BS...),
  DEL, C1 controls (the 8-bit CSI ``\\x9b`` and OSC ``\\x9d``), the bidirectional overrides
  and isolates (``U+202A-U+202E``, ``U+2066-U+2069``, ``U+200E``, ``U+200F``, ``U+061C``),
  other invisible format characters (zero-width spaces and joiners, ``U+FEFF``, the tag
  characters), line and paragraph separators, and lone surrogates. It can also cut the
  text to a number of characters (``max_chars``), saying how long it was.
- :func:`safe` is :func:`clean` and then ``rich.markup.escape``: what the CLI interpolates into
  a rich markup string or a table cell (``[/bold]`` in a site's detail is shown, not parsed).
- :func:`safe_tree` applies :func:`safe` to every string (and dict key) of a JSON-like value:
  a run summary before the CLI renders it.
- :class:`OneLineFormatter` is the daemons' log formatter (``cli/common.setup_logging``): each
  record's message is :func:`clean`\\ ed to one line, and the lines of a traceback are cleaned
  and indented, so that no remote text can start a line of its own (a forged "run ... ended"
  record) or send escape sequences to whoever tails the log.

JSON output (``--json``) needs none of this: ``json.dumps`` escapes control characters itself.
"""

from __future__ import annotations

import logging
import re

from rich.markup import escape as _escape_markup

# Characters shown as their escape: C0, DEL, C1; soft hyphen; Arabic letter mark; Mongolian
# vowel separator; zero-width space/joiners and LRM/RLM; line/paragraph separators, bidi
# embeddings and overrides; word joiner, invisible operators, bidi isolates, deprecated format
# characters; BOM; interlinear annotation; surrogates; tag characters.
UNSAFE_RE = re.compile("[\x00-\x1f\x7f-\x9f\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u206f"
                       "\ufeff\ufff9-\ufffb\ud800-\udfff\U000e0000-\U000e007f]")
TRACEBACK_INDENT = "    | "  # before each line of a logged traceback


def _escaped(match: re.Match) -> str:
    c = match.group()
    return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(c) or ascii(c)[1:-1]


def clean(text, max_chars: int | None = None) -> str:
    """``text`` (``str()`` of it when it is not a string) with every unsafe character (module
    docstring) replaced by its escape, e.g. ``"a\\nb\\x1b[31m"`` -> ``"a\\\\nb\\\\x1b[31m"``: one
    line, nothing a terminal acts on. With ``max_chars``, text longer than that is cut to it
    and ``"... (N characters)"`` appended (N: the original length). Never raises."""
    if not isinstance(text, str):
        text = str(text)
    cut = max_chars is not None and len(text) > max_chars
    out = UNSAFE_RE.sub(_escaped, text[:max_chars] if cut else text)
    return f"{out}... ({len(text)} characters)" if cut else out


def safe(text, max_chars: int | None = None) -> str:
    """``text`` ready to put into rich markup or a rich table cell: :func:`clean` (one line, no
    control or bidi character; cut to ``max_chars``), then ``rich.markup.escape``, with final
    backslashes doubled so that they cannot escape the markup that follows them."""
    out = clean(text, max_chars)
    body = out.rstrip("\\")
    # rich reads backslashes before a tag as escapes (two show as one): doubled, they show as
    # they are and the tag after them stays a tag
    return _escape_markup(body) + "\\" * (2 * (len(out) - len(body)))


def safe_tree(value, max_chars: int | None = None):
    """A copy of a JSON-like value (dicts, lists, tuples, scalars) with :func:`safe` applied to
    every string, dict keys included; numbers, booleans and None are kept."""
    if isinstance(value, str):
        return safe(value, max_chars)
    if isinstance(value, dict):
        return {safe_tree(k, max_chars) if isinstance(k, str) else k: safe_tree(v, max_chars) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(safe_tree(v, max_chars) for v in value)
    return value


class OneLineFormatter(logging.Formatter):
    """A ``logging.Formatter`` whose records are one line each: the message (with its
    arguments) is :func:`clean`\\ ed; an exception's or stack's text follows on lines that are
    each cleaned and start with ``TRACEBACK_INDENT``, so a line that starts at column 0 is
    always the start of a record."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        record.message = clean(record.message)
        return super().formatMessage(record)

    def formatException(self, ei) -> str:  # noqa: N802 - logging's name
        return _indented(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:  # noqa: N802 - logging's name
        return _indented(super().formatStack(stack_info))


def _indented(text: str) -> str:
    return "\n".join(TRACEBACK_INDENT + clean(line) for line in text.splitlines())
