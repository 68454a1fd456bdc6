# Sourced by the scripts: finds or builds the project's venv outside the checkout (keyed by the hash of
# scripts/requirements.txt, so a clean clone in CI reuses it) and installs this checkout into it.
# shellcheck shell=bash
TFDIST_CACHE=${TFDIST_CACHE:-$HOME/.cache/tfdist}
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_key=$( (cat "$_root/scripts/requirements.txt" "$_root/scripts/requirements-nodeps.txt"; python3 --version) |
  sha256sum | cut -c1-12)
VENV="$TFDIST_CACHE/venv-$_key"

GO_VERSION=${GO_VERSION:-1.26.8}

ensure_python_venv_module() {
  python3 -c 'import ensurepip, venv' 2>/dev/null || {
    echo "== installing python3-venv" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
  }
}

ensure_go() {
  # Go >= 1.26 for the Kubernetes test binaries. Where it is missing or older, fetch the official toolchain,
  # which the Go module proxy serves as the module golang.org/toolchain (what GOTOOLCHAIN=go1.x does).
  export PATH="$PATH:/usr/local/go/bin"
  local have
  have=$(go env GOVERSION 2>/dev/null | sed 's/^go//') || true
  if [ -n "$have" ] && [ "$(printf '%s\n1.26\n' "$have" | sort -V | head -1)" = "1.26" ]; then
    return 0
  fi
  local dir="$TFDIST_CACHE/go-$GO_VERSION"
  if [ ! -x "$dir/bin/go" ]; then
    echo "== fetching Go $GO_VERSION from the Go module proxy" >&2
    local zip="$TFDIST_CACHE/go-$GO_VERSION.zip" arch
    arch=$(uname -m | sed 's/x86_64/amd64/; s/aarch64/arm64/')
    mkdir -p "$TFDIST_CACHE"
    curl -fsSL -o "$zip" \
      "https://proxy.golang.org/golang.org/toolchain/@v/v0.0.1-go$GO_VERSION.linux-$arch.zip"
    python3 - "$zip" "$dir" <<'PY'
import os, stat, sys, zipfile
src, dst = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(src) as z:
    for info in z.infolist():
        parts = info.filename.split("/")  # golang.org/toolchain@v0.0.1-go1.x.os-arch/<tree>
        rel = "/".join(parts[2:])
        if not rel or info.is_dir():
            continue
        path = os.path.join(dst, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with z.open(info) as f, open(path, "wb") as out:
            out.write(f.read())
        mode = (info.external_attr >> 16) & 0o777
        os.chmod(path, mode or (0o755 if "/bin/" in path or "/tool/" in path else 0o644))
PY
    rm -f "$zip"
  fi
  export PATH="$dir/bin:$PATH" GOTOOLCHAIN=local
}

ensure_venv() {
  mkdir -p "$TFDIST_CACHE"
  # one builder at a time: a second command started meanwhile waits instead of deleting the venv under it
  exec {_venv_lock}>"$TFDIST_CACHE/.venv.lock"
  flock "$_venv_lock"
  if [ ! -x "$VENV/bin/python" ] || [ ! -f "$VENV/.complete" ]; then
    echo "== building venv $VENV (first run only; about 2 GB)" >&2
    rm -rf "$VENV"
    mkdir -p "$TFDIST_CACHE"
    ensure_python_venv_module
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q -r "$_root/scripts/requirements.txt"
    "$VENV/bin/pip" install -q --no-deps -r "$_root/scripts/requirements-nodeps.txt"
    touch "$VENV/.complete"
  fi
  flock -u "$_venv_lock"
  exec {_venv_lock}>&-
  export PATH="$VENV/bin:$PATH"
}

ensure_node() {
  command -v npm >/dev/null || {
    echo "== installing Debian's nodejs and npm" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null
  }
}

ensure_chromium() {
  if [ ! -x /usr/bin/chromium ]; then
    echo "== installing Debian's chromium" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) ||
      echo "!! could not install chromium; browser tests will fail" >&2
  fi
}

_project_hash() {
  # what goes into the wheel: the packages' files, its metadata, and the built lab extension (by its stamp)
  (cd "$_root" && {
    find core spawner kernel_magics labserver hubadmin jupyter-config -type f -not -path 'core/labextension/*' \
      -not -path '*/__pycache__/*' -not -name '*.pyc' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum
    sha256sum pyproject.toml README.md
    cat core/labextension/.build-stamp 2>/dev/null
  } | sha256sum | cut -c1-32)
}

install_project() {
  # Non-editable on purpose: the tests run against the wheel users get (namespace mapping, prebuilt extension).
  # under a lock: two installs into one venv at once leave it half-written
  local hash
  hash=$(_project_hash)  # before: an edit made during the install makes the next check reinstall
  (cd "$_root" && flock "$TFDIST_CACHE/.install.lock" \
    "$VENV/bin/pip" install -q --no-deps --force-reinstall --no-build-isolation .)
  echo "$_root $hash" >"$VENV/.tfdist-installed"
}

install_project_if_changed() {
  # scripts/run-hub: reuse the installed wheel when it came from these very sources (no 5-20 s reinstall)
  if [ -x "$VENV/bin/tfdist-local-hub" ] &&
    [ "$(cat "$VENV/.tfdist-installed" 2>/dev/null)" = "$_root $(_project_hash)" ]; then
    return 0
  fi
  install_project
}
