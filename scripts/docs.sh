#!/usr/bin/env bash
# The documentation site (mkdocs + mkdocstrings, mkdocs.yml): installs what it needs into the venv
# (scripts/setup.sh's; $HPCASYNC_VENV or .venv), builds site/ with every warning an error
# (mkdocs --strict: a broken link, a missing anchor, a page left out of the navigation, a
# docstring reference that does not resolve), then checks every link of the built HTML and that
# the API reference lists each front-door name with its signature (scripts/check_site.py).
# Usage: bash scripts/docs.sh          (build and check; open site/index.html)
#        bash scripts/docs.sh serve    (http://127.0.0.1:8000, rebuilt on each edit)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${HPCASYNC_VENV:-$repo/.venv}
[ -x "$venv/bin/python" ] || bash "$repo/scripts/setup.sh" >/dev/null
py="$venv/bin/python"
if ! "$py" -c "import mkdocs, mkdocstrings_handlers.python" 2>/dev/null; then
    echo "docs: installing mkdocs and mkdocstrings into $venv" >&2
    "$py" -m pip install -q --disable-pip-version-check -e "$repo[docs]" 2>&1 \
        | grep -v "^WARNING: Location" || true
fi
cd "$repo"
if [ "${1:-}" = serve ]; then
    exec "$py" -m mkdocs serve
fi
"$py" -m mkdocs build --strict --clean -q
"$py" scripts/check_site.py site
