"""mkdocs hooks of the documentation site (``mkdocs.yml``): pages generated from the code.

A reference page holds a marker comment; :func:`on_page_markdown` replaces it with mkdocstrings
blocks (``::: module.name``) or tables made from the code, so that the reference lists what the
code exports today and a name added to the front door appears without editing a page:

- ``<!-- api:front-door -->``: every name ``import hpcasync`` exports (``hpcasync._EXPORTS``);
- ``<!-- api:horovod -->``: every name ``hpcasync/horovod/__init__.py`` imports from its modules;
- ``<!-- cli:options -->``: each ``hpcasync`` subcommand's options, from the CLI's own parser.
"""
from __future__ import annotations

import argparse
import ast
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parent.parent


def front_door() -> str:
    import hpcasync

    by_module: dict[str, list[str]] = {}
    for name, module in hpcasync._EXPORTS.items():
        by_module.setdefault(module, []).append(name)
    out = []
    for module in sorted(by_module, key=lambda m: (m != "hpcasync.api", m)):
        for name in by_module[module]:
            out.append(f"::: {module}.{name}\n")
    return "\n".join(out)


def _documented(module_file: pathlib.Path) -> set[str]:
    """The top-level names of a module that mkdocstrings can document: functions, classes,
    single-name assignments and imported names (not a tuple unpacking's targets)."""
    names = set()
    for node in ast.parse(module_file.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom):
            names.update(a.asname or a.name for a in node.names)
    return names


def horovod() -> str:
    """The facade's names by the module they come from (its ``__all__`` is computed at import,
    so it is read from the import statements); constants defined by tuple unpacking (the
    reduction ops) are listed by name."""
    package = REPO / "hpcasync/horovod"
    tree = ast.parse((package / "__init__.py").read_text())
    out = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            module = f"hpcasync.horovod.{node.module}"
            known = _documented(package / f"{node.module}.py")
            out.append(f"## `{module}`\n")
            plain = [a.name for a in node.names if a.name not in known]
            if plain:
                out.append("Constants (Horovod's values): " + ", ".join(f"`{n}`" for n in plain)
                           + ".\n")
            out += [f"::: {module}.{a.name}\n    options:\n      heading_level: 3\n"
                    for a in node.names if a.name in known]
    out.append("## `hpcasync.horovod.elastic`\n")
    out.append("::: hpcasync.horovod.elastic\n    options:\n      show_root_heading: false\n"
               "      heading_level: 3\n")
    return "\n".join(out)


def _cell(text: str) -> str:
    return re.sub(r"\s+", " ", text).replace("|", "\\|").strip()


def cli_options() -> str:
    from hpcasync.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = []
    for name, p in sub.choices.items():
        helps = {a.dest: a.help for a in sub._choices_actions}
        out.append(f"## `hpcasync {name}`\n\n{_cell(helps.get(name) or '')}\n")
        fmt = p._get_formatter()
        for group in p._action_groups:
            rows = [a for a in group._group_actions
                    if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]
            if not rows:
                continue
            out.append(f"### {group.title}\n\n| option | default | what it does |\n|---|---|---|")
            for a in rows:
                flags = ", ".join(f"`{s}`" for s in a.option_strings) or f"`{a.dest}`"
                default = ("" if a.default in (None, argparse.SUPPRESS) or a.option_strings == []
                           else f"`{a.default}`")
                text = fmt._expand_help(a) if a.help else ""
                out.append(f"| {flags} | {default} | {_cell(text)} |")
            out.append("")
    return "\n".join(out)


MARKERS = {"<!-- api:front-door -->": front_door, "<!-- api:horovod -->": horovod,
           "<!-- cli:options -->": cli_options}


def on_page_markdown(markdown: str, **_) -> str:
    for marker, make in MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return markdown
