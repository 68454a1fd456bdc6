"""Container images without a registry or a container engine (what scripts/build-images runs).

Layers, each cached by a hash of its inputs as a tag in one OCI layout under
``${TFDIST_CACHE:-~/.cache/tfdist}/images/oci`` (tags share blobs):

    base      Debian bookworm minbase + python3 + user tfdist (uid 1000)        mmdebstrap -> tar
    jobdeps   base + docker/job.lock (tensorflow-cpu, tf-keras, ...)             pip --no-deps
    job       jobdeps + the project wheel; entrypoint tfdist.runtime.podmain      docker/job.Dockerfile
    nbdeps    jobdeps + docker/notebook.lock (jupyterhub-singleuser, JupyterLab)
    notebook  nbdeps + the project wheel (lab extension inside); jupyterhub-singleuser  notebook.Dockerfile
    hubdeps   base + docker/hub.lock (z2jh 4.4.0's hub requirements + the `hub` extra's)
    hub       hubdeps + the project wheel; tini -- jupyterhub (z2jh's hub.image)  hub_config/hub.Dockerfile
    proxy     Debian minbase + node-configurable-http-proxy (z2jh's proxy.chp.image) docker/proxy.Dockerfile

Each image is also written as an OCI archive (``images/archives/tfdist-<name>-<hash>.oci.tar``:
``skopeo copy oci-archive:FILE docker://REGISTRY/...`` pushes it) and, with ``--import``, imported into
the one-machine cluster's containerd as ``localhost/tfdist-<name>:<hash>``. ``images/current.json`` maps
each built image to its reference and archive.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("TFDIST_CACHE", Path.home() / ".cache" / "tfdist")) / "images"
LAYOUT = CACHE / "oci"
SUITE = "bookworm"
MIRRORS = (
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
)
BASE_PACKAGES = ("python3", "python-is-python3", "ca-certificates", "tini")
# Debian's build of configurable-http-proxy (4.5, Node.js 18): z2jh's proxy pod runs `configurable-http-proxy`
# with flags every 4.x and 5.x release takes; quay.io's image cannot be pulled here
PROXY_PACKAGES = ("node-configurable-http-proxy", "ca-certificates", "tini")
PROXY_USER = "65534"  # z2jh's chp securityContext runs it as nobody
HUB_SDISTS = ("onetimepass",)  # pure Python, no wheel on PyPI: built from source, the rest wheels only
IMAGES = ("base", "job", "notebook", "hub", "proxy")
PYLIB = "usr/local/lib/python3.11/dist-packages"  # where bookworm's python3 looks for local packages
JOB_ENV = {
    "PYTHONUNBUFFERED": "1",
    "TF_USE_LEGACY_KERAS": "1",
    "GRPC_FAIL_FAST": "use_caller",
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/home/tfdist",
}
RECIPE_VERSION = "1"  # bump when the recipe below changes in a way the hashed inputs do not show
APP_RECIPE_VERSION = "2"  # the same for the last layer and the image config of job and notebook
EXCLUDES = (
    "/usr/share/man/*",
    "/usr/share/doc/*",
    "/usr/share/info/*",
    "/usr/share/locale/*",
    "/usr/share/lintian/*",
)


def log(msg: str) -> None:
    print(f"build-images: {msg}", file=sys.stderr, flush=True)


def sh(*cmd: str | Path, **kw) -> str:
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if p.returncode != 0:
        raise SystemExit(
            f"build-images: {' '.join(map(str, cmd))} failed ({p.returncode}):\n{p.stderr[-3000:]}"
        )
    return p.stdout


def digest(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else p.encode())
        h.update(b"\0")
    return h.hexdigest()[:12]


def tags() -> set[str]:
    if not (LAYOUT / "index.json").exists():
        return set()
    return set(sh("umoci", "ls", "--layout", LAYOUT).split())


def umoci(*args: str | Path) -> None:
    sh("umoci", "--log", "error", *args)


def tar_layer(root: Path, out: Path) -> Path:
    """A reproducible layer tar (sorted, owner root, mtime 0)."""
    sh(
        "tar",
        "--sort=name",
        "--numeric-owner",
        "--owner=0",
        "--group=0",
        "--mtime=@0",
        "-C",
        root,
        "-cf",
        out,
        ".",
    )
    return out


def add_layer(src_tag: str, dst_tag: str, layer_tar: Path, history: str) -> None:
    umoci(
        "raw",
        "add-layer",
        "--image",
        f"{LAYOUT}:{src_tag}",
        "--tag",
        dst_tag,
        "--history.created_by",
        history,
        layer_tar,
    )


# ------------------------------------------------------------------------------------------ layers


def base(tag_hash: str, work: Path) -> None:
    out = work / "base.tar"
    cmd = [
        "mmdebstrap",
        "--variant=minbase",
        f"--include={','.join(BASE_PACKAGES)}",
        "--quiet",
        *(f"--dpkgopt=path-exclude={p}" for p in EXCLUDES),
        '--customize-hook=chroot "$1" useradd --create-home --uid 1000 --user-group tfdist',
        '--customize-hook=rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/* "$1"/var/log/*',
        SUITE,
        str(out),
        *MIRRORS,
    ]
    sh("nice", "-n", "15", *cmd, env={**os.environ, "SOURCE_DATE_EPOCH": "0"})
    if not (LAYOUT / "index.json").exists():
        umoci("init", "--layout", LAYOUT)
    umoci("new", "--image", f"{LAYOUT}:scratch-{tag_hash}")
    add_layer(f"scratch-{tag_hash}", f"base-{tag_hash}", out, "mmdebstrap minbase " + " ".join(BASE_PACKAGES))
    umoci("rm", "--image", f"{LAYOUT}:scratch-{tag_hash}")
    configure(f"base-{tag_hash}", {"PATH": JOB_ENV["PATH"]}, "0", [], ["python3"], [], "/")


def proxy(tag: str, work: Path) -> None:
    """The configurable-http-proxy image: its own minbase (no Python), Debian's package and tini."""
    out = work / "proxy.tar"
    cmd = [
        "mmdebstrap",
        "--variant=minbase",
        f"--include={','.join(PROXY_PACKAGES)}",
        "--quiet",
        *(f"--dpkgopt=path-exclude={p}" for p in EXCLUDES),
        '--customize-hook=rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/* "$1"/var/log/*',
        SUITE,
        str(out),
        *MIRRORS,
    ]
    sh("nice", "-n", "15", *cmd, env={**os.environ, "SOURCE_DATE_EPOCH": "0"})
    if not (LAYOUT / "index.json").exists():
        umoci("init", "--layout", LAYOUT)
    umoci("new", "--image", f"{LAYOUT}:scratch-{tag}")
    add_layer(f"scratch-{tag}", tag, out, "mmdebstrap minbase " + " ".join(PROXY_PACKAGES))
    umoci("rm", "--image", f"{LAYOUT}:scratch-{tag}")
    configure(
        tag,
        {"PATH": JOB_ENV["PATH"]},
        PROXY_USER,
        ["tini", "--"],
        ["configurable-http-proxy"],
        ["8000/tcp", "8001/tcp"],
        "/",
    )


def pip_layer(
    src_tag: str,
    dst_tag: str,
    work: Path,
    what: list[str],
    history: str,
    sdists: tuple[str, ...] = (),
    dirs: tuple[str, ...] = (),
) -> None:
    """``pip install --no-deps`` of ``what`` (a lock file or wheels) into /usr/local of a new layer, with
    shebangs for the image's python3 and .pyc files that never need rewriting (unchecked-hash). `sdists`:
    packages built from source (pure Python without a wheel); `dirs`: empty directories to add."""
    root = work / "root"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir()
    py = Path(sys.executable)
    sh(
        "nice",
        "-n",
        "15",
        py,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        *(f"--no-binary={name}" for name in sdists),
        "--ignore-installed",
        "--no-compile",
        "--no-warn-script-location",
        "--root",
        root,
        "--prefix",
        "/usr/local",
        *what,
    )
    local = root / "usr" / "local"
    site = local / "lib" / "python3.11" / "site-packages"
    if site.exists():  # pip of a non-Debian python says site-packages; bookworm's python3 reads dist-packages
        site.rename(site.parent / "dist-packages")
    for script in (local / "bin").glob("*") if (local / "bin").exists() else []:
        data = script.read_bytes()
        if data.startswith(b"#!") and b"python" in data.split(b"\n", 1)[0]:
            script.write_bytes(b"#!/usr/bin/python3" + data[data.index(b"\n") :])
    for d in dirs:
        (root / d).mkdir(parents=True, exist_ok=True)
    tf_include = root / PYLIB / "tensorflow" / "include"
    shutil.rmtree(tf_include, ignore_errors=True)  # C++ headers: 287 MB nobody in a pod needs
    # Without .pyc files every container's first `import tensorflow` takes 13 s instead of ~5 s.
    # (exit status ignored: a few test files in wheels are not valid Python 3.11 on purpose)
    subprocess.run(
        [
            "nice",
            "-n",
            "15",
            str(py),
            "-m",
            "compileall",
            "-q",
            "-j",
            "0",
            "--invalidation-mode",
            "unchecked-hash",
            "-s",
            str(root),
            "-p",
            "/",
            str(root / PYLIB),
        ],
        capture_output=True,
    )
    add_layer(src_tag, dst_tag, tar_layer(root, work / "layer.tar"), history)
    shutil.rmtree(root, ignore_errors=True)
    (work / "layer.tar").unlink()


def wheel(work: Path) -> Path:
    """The project wheel (with the prebuilt lab extension: scripts/build-images builds it first)."""
    out = work / "wheel"
    sh(
        "nice",
        "-n",
        "15",
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--quiet",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        out,
        REPO,
    )
    (whl,) = out.glob("jupyter_tfdist-*.whl")
    return whl


def wheel_hash(whl: Path) -> str:
    """Content hash (not the zip's timestamps), so an unchanged checkout keeps its image."""
    with zipfile.ZipFile(whl) as z:
        return digest(
            *(
                f"{i.filename}:{hashlib.sha256(z.read(i)).hexdigest()}"
                for i in sorted(z.infolist(), key=lambda i: i.filename)
                if not i.filename.endswith("RECORD")
            )
        )


def configure(
    tag: str, env: dict, user: str, entrypoint: list[str], cmd: list[str], ports: list[str], workdir: str
) -> None:
    args = [
        "config",
        "--image",
        f"{LAYOUT}:{tag}",
        "--config.user",
        user,
        "--config.workingdir",
        workdir,
        "--history.created_by",
        "tfdist config",
    ]
    for k, v in env.items():
        args += ["--config.env", f"{k}={v}"]
    for e in entrypoint:
        args += ["--config.entrypoint", e]
    for c in cmd:
        args += ["--config.cmd", c]
    for p in ports:
        args += ["--config.exposedports", p]
    if not entrypoint:
        args += ["--clear=config.entrypoint"]
    if not cmd:
        args += ["--clear=config.cmd"]
    umoci(*args)


# ------------------------------------------------------------------------------------- export/import


def export_archive(tag: str, out: Path) -> None:
    """An OCI archive holding only ``tag`` (ref name = the tag): skopeo/crane/ctr read it."""
    index = json.loads((LAYOUT / "index.json").read_text())
    (desc,) = [
        m
        for m in index["manifests"]
        if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag
    ]
    manifest = json.loads(blob(desc["digest"]).read_text())
    blobs = [desc["digest"], manifest["config"]["digest"], *(layer["digest"] for layer in manifest["layers"])]
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        d = Path(tmp)
        (d / "blobs" / "sha256").mkdir(parents=True)
        shutil.copy(LAYOUT / "oci-layout", d / "oci-layout")
        (d / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [desc]}))
        for b in blobs:
            os.link(blob(b), d / "blobs" / "sha256" / b.split(":", 1)[1])
        tmp_out = out.with_suffix(".part")
        sh("tar", "--sort=name", "--owner=0", "--group=0", "--mtime=@0", "-C", d, "-cf", tmp_out, ".")
        tmp_out.rename(out)


def blob(dig: str) -> Path:
    return LAYOUT / "blobs" / "sha256" / dig.split(":", 1)[1]


def image_size(tag: str) -> int:
    index = json.loads((LAYOUT / "index.json").read_text())
    (desc,) = [
        m
        for m in index["manifests"]
        if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag
    ]
    manifest = json.loads(blob(desc["digest"]).read_text())
    return sum(layer["size"] for layer in manifest["layers"])


def containerd_import(archive: Path, name: str, address: str) -> None:
    """Into the cluster's containerd (namespace k8s.io) as localhost/tfdist-<name>:<hash>."""
    sh(
        "ctr",
        "--address",
        address,
        "-n",
        "k8s.io",
        "images",
        "import",
        "--base-name",
        f"localhost/tfdist-{name}",
        archive,
        timeout=900,
    )


def imported(ref: str, address: str) -> bool:
    out = subprocess.run(
        ["ctr", "--address", address, "-n", "k8s.io", "images", "ls", "-q"], capture_output=True, text=True
    )
    return out.returncode == 0 and ref in out.stdout.split()


# ---------------------------------------------------------------------------------------------- main


def layer_hashes() -> tuple[str, str, str]:
    """Input hashes of the base, jobdeps and nbdeps layers."""
    h_base = digest(RECIPE_VERSION, SUITE, *MIRRORS, *BASE_PACKAGES, *EXCLUDES)
    h_jobdeps = digest(h_base, (REPO / "docker" / "job.lock").read_text())
    h_nbdeps = digest(h_jobdeps, (REPO / "docker" / "notebook.lock").read_text())
    return h_base, h_jobdeps, h_nbdeps


def hub_hashes() -> tuple[str, str]:
    """Input hashes of the hubdeps layer and of the proxy image."""
    h_base = layer_hashes()[0]
    h_hubdeps = digest(h_base, (REPO / "docker" / "hub.lock").read_text(), *HUB_SDISTS)
    h_proxy = digest(RECIPE_VERSION, SUITE, *MIRRORS, *PROXY_PACKAGES, *EXCLUDES, PROXY_USER)
    return h_hubdeps, h_proxy


def build(names: list[str], do_import: bool, address: str) -> dict:
    CACHE.mkdir(parents=True, exist_ok=True)
    (CACHE / "archives").mkdir(exist_ok=True)
    have = tags()
    timings: dict[str, float] = {}
    h_base, h_jobdeps, h_nbdeps = layer_hashes()
    h_hubdeps, h_proxy = hub_hashes()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        work = Path(tmp)

        def step(tag: str, fn) -> None:
            if tag in have:
                return
            t0 = time.monotonic()
            log(f"building {tag}")
            fn()
            timings[tag.rsplit("-", 1)[0]] = round(time.monotonic() - t0, 1)
            have.add(tag)

        step(f"base-{h_base}", lambda: base(h_base, work))
        final: dict[str, str] = {"base": f"base-{h_base}"}
        if "proxy" in names:
            step(f"proxy-{h_proxy}", lambda: proxy(f"proxy-{h_proxy}", work))
            final["proxy"] = f"proxy-{h_proxy}"
        if "hub" in names:
            step(
                f"hubdeps-{h_hubdeps}",
                lambda: pip_layer(
                    f"base-{h_base}",
                    f"hubdeps-{h_hubdeps}",
                    work,
                    ["-r", str(REPO / "docker" / "hub.lock")],
                    "pip install --no-deps -r docker/hub.lock",
                    sdists=HUB_SDISTS,
                ),
            )
        if {"job", "notebook", "hub"} & set(names):
            step(
                f"jobdeps-{h_jobdeps}",
                lambda: pip_layer(
                    f"base-{h_base}",
                    f"jobdeps-{h_jobdeps}",
                    work,
                    ["-r", str(REPO / "docker" / "job.lock")],
                    "pip install --no-deps -r docker/job.lock",
                ),
            )
            t0 = time.monotonic()
            whl = wheel(work)
            h_app = wheel_hash(whl)
            timings["wheel"] = round(time.monotonic() - t0, 1)
            if "job" in names:
                tag = f"job-{digest(APP_RECIPE_VERSION, h_jobdeps, h_app)}"

                def job() -> None:
                    pip_layer(
                        f"jobdeps-{h_jobdeps}", tag, work, [str(whl)], "pip install --no-deps <project wheel>"
                    )
                    configure(
                        tag,
                        JOB_ENV,
                        "1000",
                        ["python3", "-m", "tfdist.runtime.podmain"],
                        [],
                        ["2222/tcp", "8470/tcp"],
                        "/home/tfdist",
                    )

                step(tag, job)
                final["job"] = tag
            if "notebook" in names:
                step(
                    f"nbdeps-{h_nbdeps}",
                    lambda: pip_layer(
                        f"jobdeps-{h_jobdeps}",
                        f"nbdeps-{h_nbdeps}",
                        work,
                        ["-r", str(REPO / "docker" / "notebook.lock")],
                        "pip install --no-deps -r docker/notebook.lock",
                    ),
                )
                tag = f"notebook-{digest(APP_RECIPE_VERSION, h_nbdeps, h_app)}"

                def notebook() -> None:
                    pip_layer(
                        f"nbdeps-{h_nbdeps}", tag, work, [str(whl)], "pip install --no-deps <project wheel>"
                    )
                    configure(
                        tag,
                        {**JOB_ENV, "SHELL": "/bin/bash"},
                        "1000",
                        ["tini", "-g", "--"],
                        ["jupyterhub-singleuser"],
                        ["8888/tcp"],
                        "/home/tfdist",
                    )

                step(tag, notebook)
                final["notebook"] = tag
            if "hub" in names:
                tag = f"hub-{digest(APP_RECIPE_VERSION, h_hubdeps, h_app)}"

                def hub() -> None:
                    # /srv/jupyterhub: the working directory, where z2jh mounts the hub's database volume
                    pip_layer(
                        f"hubdeps-{h_hubdeps}",
                        tag,
                        work,
                        [str(whl)],
                        "pip install --no-deps <project wheel>",
                        dirs=("srv/jupyterhub",),
                    )
                    configure(
                        tag,
                        {"PYTHONUNBUFFERED": "1", "PATH": JOB_ENV["PATH"], "HOME": "/home/tfdist"},
                        "1000",
                        ["tini", "--"],
                        ["jupyterhub", "--config", "/usr/local/etc/jupyterhub/jupyterhub_config.py"],
                        ["8081/tcp"],
                        "/srv/jupyterhub",
                    )

                step(tag, hub)
                final["hub"] = tag
    for name, tag in final.items():
        if name not in names:
            continue
        h = tag.rsplit("-", 1)[1]
        archive = CACHE / "archives" / f"tfdist-{name}-{h}.oci.tar"
        if not archive.exists():
            t0 = time.monotonic()
            export_archive(tag, archive)
            timings[f"archive-{name}"] = round(time.monotonic() - t0, 1)
        ref = f"localhost/tfdist-{name}:{tag}"
        if do_import and not imported(ref, address):
            t0 = time.monotonic()
            containerd_import(archive, name, address)
            timings[f"import-{name}"] = round(time.monotonic() - t0, 1)
        results[name] = {
            "ref": ref,
            "archive": str(archive),
            "layers_bytes": image_size(tag),
            "archive_bytes": archive.stat().st_size,
        }
    current = CACHE / "current.json"
    old = json.loads(current.read_text()) if current.exists() else {}
    old.update(results)
    current.write_text(json.dumps(old, indent=1))
    prune_archives(keep={v["archive"] for v in old.values()})
    return {"images": results, "timings": timings}


KEEP_ARCHIVES = 3  # per image: a checkout's build and a couple of others' (current.json's are kept too)


def prune_archives(keep: set[str], per_image: int = KEEP_ARCHIVES) -> list[Path]:
    """Drop all but the newest `per_image` archives of each image (and those in `keep`). Why: each
    change of the project writes a new job and notebook archive (0.4 + 0.6 GB) under a new hash, so a
    developer's or a test machine's cache grew by a gigabyte per change until the disk ran out; the
    layers stay shared in the OCI layout (`--gc` prunes that too)."""
    by_image: dict[str, list[Path]] = {}
    for path in (CACHE / "archives").glob("tfdist-*-*.oci.tar"):
        by_image.setdefault(path.name.rsplit("-", 1)[0], []).append(path)
    dropped = []
    for paths in by_image.values():
        paths.sort(key=lambda p: p.stat().st_mtime, reverse=True)
        for path in paths[per_image:]:
            if str(path) not in keep:
                path.unlink(missing_ok=True)
                dropped.append(path)
    return dropped


def gc() -> None:
    """Drop every tag that current.json does not name (nor the layers under it), then unreferenced blobs."""
    current = json.loads((CACHE / "current.json").read_text()) if (CACHE / "current.json").exists() else {}
    h_base, h_jobdeps, h_nbdeps = layer_hashes()
    keep = {v["ref"].split(":", 1)[1] for v in current.values()}
    keep |= {f"base-{h_base}", f"jobdeps-{h_jobdeps}", f"nbdeps-{h_nbdeps}", f"hubdeps-{hub_hashes()[0]}"}
    for tag in tags() - keep:
        umoci("rm", "--image", f"{LAYOUT}:{tag}")
    umoci("gc", "--layout", LAYOUT)
    archives = {v["archive"] for v in current.values()}
    for old in (CACHE / "archives").glob("*.oci.tar"):
        if str(old) not in archives:
            old.unlink()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="scripts/build-images", description=__doc__.split("\n\n")[0])
    ap.add_argument("images", nargs="*", default=["job"], help=f"{', '.join(IMAGES)} (default: job)")
    ap.add_argument(
        "--import",
        dest="do_import",
        action="store_true",
        help="import into the running one-machine cluster's containerd (scripts/cluster up)",
    )
    ap.add_argument("--containerd", default="/run/tfdist-cluster/containerd/containerd.sock")
    ap.add_argument("--gc", action="store_true", help="then drop every older image and layer from the cache")
    a = ap.parse_args(argv)
    bad = [n for n in a.images if n not in IMAGES]
    if bad:
        ap.error(f"unknown image {', '.join(bad)} ({', '.join(IMAGES)})")
    if a.do_import and not os.path.exists(a.containerd):
        ap.error(f"no containerd at {a.containerd}: start the cluster first (scripts/cluster up)")
    t0 = time.monotonic()
    r = build(a.images, a.do_import, a.containerd)
    if a.gc:
        gc()
    for name, img in r["images"].items():
        print(f"{name}\t{img['ref']}\t{img['archive']}\t{img['archive_bytes'] / 1e6:.0f} MB")
    log(f"done in {time.monotonic() - t0:.1f} s {json.dumps(r['timings'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
