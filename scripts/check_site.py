"""Check the built documentation site (``scripts/docs.sh`` runs it after ``mkdocs build``).

1. Every link of every built page resolves: a relative ``href``/``src`` names a file of the site,
   and its ``#fragment`` an ``id`` of that page (external ``http(s):``/``mailto:`` links are not
   fetched: the build machines have no network).
2. The API reference lists every name ``import hpcasync`` exports (``hpcasync._EXPORTS``), each
   under its own heading with its signature (mkdocstrings' ``doc-signature`` block; classes
   included, whose signature is their constructor's; a base class without a constructor of
   its own is listed without one).

Usage: ``python scripts/check_site.py site``; prints one line per problem, exits 1 if any.
"""
from __future__ import annotations

import html.parser
import pathlib
import posixpath
import sys
import urllib.parse

SKIP = ("http:", "https:", "mailto:", "data:", "javascript:")


class Page(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.signed: list[str] = []        # the ids of headings followed by a signature block
        self._heading: str | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
            if tag in ("h1", "h2", "h3", "h4"):
                self._heading = a["id"]
        if a.get("name") and tag == "a":
            self.ids.add(a["name"])
        for key in ("href", "src"):
            if a.get(key) and tag in ("a", "img", "script", "link"):
                self.links.append(a[key])
        if "doc-signature" in (a.get("class") or "").split() and self._heading:
            self.signed.append(self._heading)
            self._heading = None


def parse(path: pathlib.Path) -> Page:
    page = Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def check_links(site: pathlib.Path) -> list[str]:
    pages = {p.relative_to(site).as_posix(): parse(p) for p in site.rglob("*.html")}
    problems = []
    for name, page in sorted(pages.items()):
        for link in page.links:
            if link.startswith(SKIP) or link.startswith("//"):
                continue
            url = urllib.parse.urlsplit(link)
            path = urllib.parse.unquote(url.path)
            if path.startswith("/"):        # from the site's root (the 404 page's links)
                target = posixpath.normpath(path.lstrip("/"))
            else:
                target = name if not path else posixpath.normpath(
                    posixpath.join(posixpath.dirname(name), path))
            if target.endswith("/"):
                target += "index.html"
            if not (site / target).is_file():
                if (site / target).is_dir() and (site / target / "index.html").is_file():
                    target = f"{target}/index.html"
                else:
                    problems.append(f"{name}: broken link {link!r} (no file {target})")
                    continue
            frag = urllib.parse.unquote(url.fragment)
            if frag and target.endswith(".html") and frag not in pages[target].ids:
                problems.append(f"{name}: broken link {link!r} (no id {frag!r} in {target})")
    return problems


def check_api(site: pathlib.Path) -> list[str]:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    import importlib

    import hpcasync

    page = parse(site / "reference" / "front-door.html")
    problems = []
    for name, module in sorted(hpcasync._EXPORTS.items()):
        ident = f"{module}.{name}"
        if ident not in page.ids:
            problems.append(f"reference/front-door.html: hpcasync.{name} is not listed ({ident})")
        elif ident not in page.signed and not _no_constructor(
                getattr(importlib.import_module(module), name)):
            problems.append(f"reference/front-door.html: hpcasync.{name} has no signature")
    return problems


def _no_constructor(obj) -> bool:
    """A class that defines no ``__init__`` of its own (a base class): no signature to show."""
    import inspect

    return inspect.isclass(obj) and "__init__" not in vars(obj)


def main(argv: list[str]) -> int:
    site = pathlib.Path(argv[1] if len(argv) > 1 else "site")
    if not (site / "index.html").is_file():
        print(f"check_site: {site} holds no built site (run mkdocs build)")
        return 1
    problems = check_links(site) + check_api(site)
    for line in problems:
        print(f"check_site: {line}")
    n = len(list(site.rglob("*.html")))
    print(f"check_site: {n} pages, {'no problem' if not problems else f'{len(problems)} problem(s)'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
