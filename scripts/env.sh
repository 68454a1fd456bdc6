# Sourced by the scripts: finds or builds the project's venv outside the checkout (keyed by the hash of
# scripts/requirements.txt, so a clean clone in CI reuses it) and installs this checkout into it.
# shellcheck shell=bash
TFDIST_CACHE=${TFDIST_CACHE:-$HOME/.cache/tfdist}
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_key=$( (cat "$_root/scripts/requirements.txt"; python3 --version) | sha256sum | cut -c1-12)
VENV="$TFDIST_CACHE/venv-$_key"

ensure_venv() {
  if [ ! -x "$VENV/bin/python" ] || [ ! -f "$VENV/.complete" ]; then
    echo "== building venv $VENV (first run only; about 2 GB)" >&2
    rm -rf "$VENV"
    mkdir -p "$TFDIST_CACHE"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q -r "$_root/scripts/requirements.txt"
    touch "$VENV/.complete"
  fi
  export PATH="$VENV/bin:$PATH"
}

ensure_node() {
  command -v npm >/dev/null || { apt-get update -qq && apt-get install -y -qq nodejs npm >/dev/null; }
}

ensure_chromium() {
  if [ ! -x /usr/bin/chromium ]; then
    echo "== installing Debian's chromium" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) ||
      echo "!! could not install chromium; browser tests will fail" >&2
  fi
}

install_project() {
  # Non-editable on purpose: the tests run against the wheel users get (namespace mapping, prebuilt extension).
  (cd "$_root" && "$VENV/bin/pip" install -q --no-deps --force-reinstall --no-build-isolation .)
}
