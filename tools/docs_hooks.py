"""mkdocs hook: the command-line reference (docs/cli.md) generated from the CLI's own parser.

The page holds a marker, ``<!-- cli-reference -->``; at build time it is replaced by the help
of ``ds41numba`` and of each subcommand, as ``ds41numba <command> --help`` prints it, so the
reference cannot drift from the options the code accepts.
"""

from __future__ import annotations

import argparse
import os

MARKER = "<!-- cli-reference -->"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:   # argparse keeps its subparsers as one action
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def cli_reference() -> str:
    """The help texts of the command and its subcommands, as Markdown."""
    from ds41numba.cli import _build_parser

    os.environ["COLUMNS"] = "100"   # argparse wraps to the terminal's width: fix it
    parser = _build_parser()
    parts = ["## ds41numba", "", "```text", parser.format_help().rstrip(), "```", ""]
    for name, sub in _subcommands(parser).items():
        parts += [f"## ds41numba {name}", "", "```text", sub.format_help().rstrip(), "```", ""]
    return "\n".join(parts)


def on_page_markdown(markdown, page, config, files):
    if MARKER in markdown:
        return markdown.replace(MARKER, cli_reference())
    return markdown
