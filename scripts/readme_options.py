"""The README's option tables, rendered from the command line's own
declarations (the same Click options ``--help`` shows).

Run as a script, it writes every ``<!-- options: KEY -->`` ... ``<!-- end -->``
block of README.md again; a test imports ``render_readme`` and checks that
the README holds the tables as rendered.

Keys: ``command NAME`` is a table of that command's own options (those in
no help panel), followed by the shared groups it also takes; ``shared
PANEL`` is a table of the options of one help panel, with the commands that
take it. Each row gives the flags, the default as ``--help`` shows it, and
the help text.
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

sys.path.insert(0, str(ROOT))

import typer.core  # noqa: E402
import typer.main  # noqa: E402

from redrafter_mlx.cli import app  # noqa: E402


def command_options(name: str) -> list:
    """The options of one command (click parameters), in declaration order."""
    group = typer.main.get_command(app)
    return [p for p in group.commands[name].params if isinstance(p, typer.core.TyperOption) and not p.hidden]


def _default_text(option) -> str:
    if option.required:
        return "required"
    if isinstance(option.show_default, str):
        return option.show_default
    if option.default is None or option.default is False or option.is_flag:
        return ""
    return str(option.default)


def _row(option) -> str:
    flags = ", ".join(f"`{flag}`" for flag in option.opts + option.secondary_opts)
    return f"| {flags} | {_default_text(option)} | {option.help} |"


def option_table(options: list) -> str:
    return "\n".join(["| option | default | meaning |", "|---|---|---|"] + [_row(o) for o in options])


def option_tables() -> dict:
    """Markdown tables keyed by README marker: ``shared <panel>`` for each
    shared group (with the commands that take it), ``command <name>`` for
    each command's own options (and the shared groups it also takes)."""
    names = list(typer.main.get_command(app).commands)
    groups: dict = {}  # panel -> {option name: option}, in first-seen order
    takes: dict = {}  # command -> {panel: [option names]}
    users: dict = {}  # panel -> commands
    for name in names:
        for option in command_options(name):
            panel = getattr(option, "rich_help_panel", None)
            if panel is not None:
                groups.setdefault(panel, {}).setdefault(option.name, option)
                takes.setdefault(name, {}).setdefault(panel, []).append(option.name)
                if name not in users.setdefault(panel, []):
                    users[panel].append(name)
    tables = {}
    for name in names:
        own = [o for o in command_options(name) if getattr(o, "rich_help_panel", None) is None]
        table = option_table(own) if own else "No options of its own."
        plus = []
        for panel, taken in takes.get(name, {}).items():
            left_out = [o for n, o in groups[panel].items() if n not in taken]
            if len(taken) <= len(left_out):
                plus.append(f"{panel} ({', '.join(f'`{groups[panel][n].opts[0]}`' for n in taken)} only)")
            elif left_out:
                plus.append(f"{panel} (not {', '.join(f'`{o.opts[0]}`' for o in left_out)})")
            else:
                plus.append(panel)
        if plus:
            table += f"\n\nPlus the shared options: {'; '.join(plus)}."
        tables[f"command {name}"] = table
    for panel, options in groups.items():
        taken_by = ", ".join(f"`{user}`" for user in users[panel])
        tables[f"shared {panel}"] = f"Taken by {taken_by}:\n\n" + option_table(list(options.values()))
    return tables


def render_readme(text: str) -> str:
    """The README with every ``<!-- options: KEY -->`` ... ``<!-- end -->``
    block replaced by the current table for KEY."""
    tables = option_tables()

    def replace(match):
        key = match.group(1)
        if key not in tables:
            raise KeyError(f"README names options {key!r}, which no command has")
        return f"<!-- options: {key} -->\n{tables[key]}\n<!-- end -->"

    return re.sub(r"<!-- options: (.+?) -->\n.*?<!-- end -->", replace, text, flags=re.S)


def main() -> None:
    text = README.read_text()
    rendered = render_readme(text)
    if rendered != text:
        README.write_text(rendered)
        print(f"{README}: option tables written")
    else:
        print(f"{README}: option tables already current")


if __name__ == "__main__":
    main()
