#!/usr/bin/env bash
# The package as users install it: build the wheel from the working tree, install it into an
# empty folder, and check that
#   1. the only top-level package it adds is `layercut` (no generic `compress`, `export`, ...);
#   2. it imports from there, and a bare `import compress` finds nothing;
#   3. its import layers hold (import-linter, contracts in pyproject.toml [tool.importlinter]).
# The layer check reads the installed copy because the source folders compress/, calibrate/,
# heal/ and export/ sit beside layercut/ and only become layercut.* in the installed layout.
#
#   bash scripts/check_package.sh          # in the dev virtualenv (pip install -e ".[dev]")
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

mkdir -p "$TMP/src"
# the working tree as git sees it (tracked and untracked-not-ignored files that exist)
git ls-files -z --cached --others --exclude-standard \
  | python -c "import os, sys; sys.stdout.write(''.join(p + '\0' for p in sys.stdin.read().split('\0') if os.path.isfile(p)))" \
  | tar --null -T - -cf - | tar -xf - -C "$TMP/src"
python -m pip wheel -q --no-deps -w "$TMP/dist" "$TMP/src" > "$TMP/wheel.log" 2>&1 || { cat "$TMP/wheel.log"; exit 1; }
python -m pip install -q --no-deps --no-compile --target "$TMP/site" "$TMP"/dist/layercut-*.whl \
  > "$TMP/install.log" 2>&1 || { cat "$TMP/install.log"; exit 1; }

top="$(cd "$TMP/site" && ls -1 | grep -v -e '\.dist-info$' -e '^bin$' | tr '\n' ' ')"
if [ "$top" != "layercut " ]; then
  echo "check_package: the wheel installs top-level '$top', expected only 'layercut'"; exit 1
fi
cd "$TMP"
PYTHONPATH="$TMP/site" python - "$TMP/site" <<'EOF'
import importlib.util
import sys

import layercut
import layercut.compress.workflow.cli  # noqa: F401
import layercut.export.card  # noqa: F401

site = sys.argv[1]
assert layercut.__file__.startswith(site), layercut.__file__
assert layercut.compress.workflow.cli.__file__.startswith(site), layercut.compress.workflow.cli.__file__
for bare in ("compress", "calibrate", "heal", "export"):
    assert importlib.util.find_spec(bare) is None, f"a bare '{bare}' is importable"
print(f"check_package: wheel installs only layercut ({len(sys.modules)} modules import)")
EOF
if grep -q '^\[tool.importlinter\]' "$REPO/pyproject.toml"; then
  PYTHONPATH="$TMP/site" lint-imports --config "$REPO/pyproject.toml"
fi
# No import cycle at all (function-level and TYPE_CHECKING imports counted), and layercut imports
# inside function bodies only in the entry points (docs/architecture.md).
python "$REPO/scripts/check_imports.py"
