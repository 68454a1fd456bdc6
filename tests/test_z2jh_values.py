"""The admin's recipe in hub_config/values.yaml, rendered against the real z2jh chart (4.4.0, vendored in
shared/vendor) by a real `helm` (scripts/build-helm), and checked for the tenancy guarantees an admin
relies on:

* the hub runs as ServiceAccount `hub` in jhub, the subject rbac-hub-tenancy.yaml and rbac-hub-gpu-view.yaml
  bind (after the recipe's `sed`) and the admission policy bounds;
* the hub's config, run as the hub runs it (the chart's own jupyterhub_config.py and z2jh.py from the rendered
  ConfigMap, the rendered Secret's values, the files and environment the rendered Deployment gives the hub
  container), selects TfdistKubeSpawner with user namespaces, loads the profiles file where TFDIST_PROFILES
  points, runs notebooks as `tfdist-notebook`, with no privileged or capability-adding init container (Pod
  Security "restricted" in user namespaces would refuse the pod), and hands notebooks a hub URL that
  resolves from their namespaces;
* no object of the recipe grants a notebook or user service account anything in jhub, and none carries
  rbac-notebook.yaml's rules there;
* z2jh's hub NetworkPolicy admits notebooks of the user namespaces to the hub's API port.

Each check is a function that returns its problems; the tests run it on the recipe (no problems) and on a
copy of values.yaml with one realistic mistake (that problem). Nothing is deployed.

Needs the helm binary (scripts/build-helm; scripts/build-k8s runs it) and shared/ beside the checkout:
missing, the tests skip, or fail when $CI is set.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("TFDIST_SHARED") or REPO.parent / "shared")
CHART = SHARED / "vendor" / "z2jh-4.4.0" / "jupyterhub"
NS = "jhub"
RELEASE = "jhub"
VALUES = "hub_config/values.yaml"
PROFILES = "hub_config/profiles.yaml"
SPAWNER = "tfdist.spawner.kube.TfdistKubeSpawner"
NOTEBOOK_SA = "tfdist-notebook"
TENANT_LABEL = "tfdist.io/tenant"
HUB_ACCESS_LABEL = "hub.jupyter.org/network-access-hub"


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _missing(msg: str) -> None:
    if _in_ci():
        pytest.fail(msg + " [CI is set, so this is an error]", pytrace=False)
    pytest.skip(msg)


@pytest.fixture(scope="module")
def helm() -> str:
    env = os.environ.get("TFDIST_HELM_BIN")
    if env:
        path = Path(env)
    else:
        out = subprocess.run(
            [str(REPO / "scripts" / "build-helm"), "--print-bindir"],
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        )
        path = Path(out.stdout.strip()) / "helm"
    if not os.access(path, os.X_OK):
        _missing(f"helm missing at {path} (run scripts/build-helm)")
    if not (CHART / "Chart.yaml").is_file():
        _missing(f"the z2jh 4.4.0 chart is missing at {CHART} (shared/ beside the checkout)")
    return str(path)


def render(helm: str, values: str | Path = VALUES, *extra: str) -> list[dict[str, Any]]:
    """`helm template` exactly as the recipe runs `helm upgrade --install` (paths relative to the repo)."""
    p = subprocess.run(
        [helm, "template", RELEASE, str(CHART), "-n", NS, "--values", str(values),
         "--set-file", f"hub.extraFiles.tfdist-profiles.stringData={PROFILES}", *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, f"helm template failed:\n{p.stderr}"
    # z2jh's templates name no namespace: helm installs them in the release's (-n jhub)
    return applied_in([d for d in yaml.safe_load_all(p.stdout) if d], NS)


def recipe_rbac(name: str, namespace: str = NS) -> list[dict[str, Any]]:
    """A hub_config file as the recipe applies it: `sed 's/NAMESPACE/jhub/' ... | kubectl apply -f -`."""
    text = (REPO / "hub_config" / name).read_text().replace("NAMESPACE", namespace)
    return [d for d in yaml.safe_load_all(text) if d]


CLUSTER_SCOPED = (
    "ClusterRole",
    "ClusterRoleBinding",
    "Namespace",
    "PriorityClass",
    "StorageClass",
    "FlowSchema",
    "PriorityLevelConfiguration",
)


def applied_in(docs: list[dict[str, Any]], namespace: str) -> list[dict[str, Any]]:
    """`kubectl apply -n <namespace>`: namespaced objects without a namespace land there."""
    out = copy.deepcopy(docs)
    for d in out:
        if d["kind"] not in CLUSTER_SCOPED and "Admission" not in d["kind"]:
            d["metadata"].setdefault("namespace", namespace)
    return out


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name}, rendered {len(found)}"
    return found[0]


def hub_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    spec = one(docs, "Deployment", "hub")["spec"]["template"]["spec"]
    return next(c for c in spec["containers"] if c["name"] == "hub")


def secret_data(secret: dict[str, Any]) -> dict[str, str]:
    data = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    data.update(secret.get("stringData") or {})
    return data


def edited_values(tmp_path: Path, edit) -> Path:
    """A copy of values.yaml with one mistake (edit(values) changes the loaded dict in place)."""
    values = yaml.safe_load((REPO / VALUES).read_text())
    edit(values)
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values, sort_keys=False))
    return path


# ---------------------------------------------------------------------------------------------------------
# The hub as the hub pod runs it: files and environment from the rendered Deployment, under a root dir.

HARNESS = textwrap.dedent(
    """
    import json, os, sys

    spec = json.load(open(sys.argv[1]))
    os.environ.update(spec["env"])
    # the chart asks for tornado's curl client (pycurl is in the hub image, not in the test venv)
    import tornado.httpclient
    tornado.httpclient.AsyncHTTPClient.configure = classmethod(lambda cls, *a, **k: None)
    from traitlets.config import Config

    c = Config()
    path = spec["config_file"]
    result = {}
    try:
        exec(compile(open(path).read(), path, "exec"), {"__file__": path, "get_config": lambda: c})
    except SystemExit as e:
        result["exit"] = f"SystemExit({e.code})"
    except BaseException as e:
        result["exit"] = f"{type(e).__name__}: {e}"
    if "exit" not in result:
        from traitlets.utils.importstring import import_item

        cls = import_item(c.JupyterHub.spawner_class)

        def effective(name):  # what a spawner of class `cls` gets: its own section, then its bases'
            for base in cls.__mro__:
                section = c.get(base.__name__)
                if section is not None and name in section:
                    return section[name]
            trait = cls.class_traits().get(name)
            return None if trait is None else trait.default_value

        def plain(x):
            return x.to_dict() if hasattr(x, "to_dict") else x

        result = {
            "spawner_class": c.JupyterHub.spawner_class,
            "spawner_mro": [f"{b.__module__}.{b.__name__}" for b in cls.__mro__],
            "hub_connect_url": c.JupyterHub.hub_connect_url,
            **{n: effective(n) for n in ("enable_user_namespaces", "user_namespace_template",
                                         "service_account", "profiles_file", "extra_labels",
                                         "egress_api_server")},
            "init_containers": [plain(x) for x in effective("init_containers")],
            "extra_containers": [plain(x) for x in effective("extra_containers")],
        }
    print("RESULT " + json.dumps(result, default=str))
    """
)


def run_hub_config(docs: list[dict[str, Any]], root: Path) -> dict[str, Any]:
    """Lay out the files the hub container mounts (ConfigMap and Secret volumes, subPath and items as the
    kubelet does) under `root`, give it the container's environment plus the Services' *_SERVICE_* ones,
    then run the chart's jupyterhub_config.py (and so hub.extraConfig) as JupyterHub would."""
    pod = one(docs, "Deployment", "hub")["spec"]["template"]["spec"]
    container = hub_container(docs)
    secrets = {s["metadata"]["name"]: secret_data(s) for s in find(docs, "Secret")}
    configmaps = {m["metadata"]["name"]: dict(m.get("data") or {}) for m in find(docs, "ConfigMap")}

    def rooted(path: str) -> Path:
        return root / path.lstrip("/")

    for mount in container.get("volumeMounts", []):
        vol = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        if "configMap" in vol:
            src, files = vol["configMap"], configmaps.get(vol["configMap"]["name"])
        elif "secret" in vol:
            src, files = vol["secret"], secrets.get(vol["secret"]["secretName"])
        else:
            continue  # the database PVC
        if files is None:
            continue  # an optional volume whose object the chart does not render
        if src.get("items"):
            files = {i["path"]: files[i["key"]] for i in src["items"]}
        if mount.get("subPath"):
            target = rooted(mount["mountPath"])
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(files[mount["subPath"]])
        else:
            for key, text in files.items():
                target = rooted(mount["mountPath"]) / key
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(text)
    # the chart's code reads its files at fixed paths: they are under root here
    etc = "/usr/local/etc/jupyterhub"
    for name in ("jupyterhub_config.py", "z2jh.py"):
        f = rooted(f"{etc}/{name}")
        f.write_text(f.read_text().replace(etc, str(rooted(etc))))

    env: dict[str, str] = {}
    for svc in find(docs, "Service"):
        key = svc["metadata"]["name"].upper().replace("-", "_")
        env[f"{key}_SERVICE_HOST"] = "10.96.0.10"
        env[f"{key}_SERVICE_PORT"] = str(svc["spec"]["ports"][0]["port"])
    for e in container.get("env", []):
        source = e.get("valueFrom") or {}
        if "value" in e:
            value = str(e["value"])
        elif source.get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
            value = NS
        elif "secretKeyRef" in source:
            value = secrets[source["secretKeyRef"]["name"]][source["secretKeyRef"]["key"]]
        else:
            continue
        env[e["name"]] = str(rooted(value)) if value.startswith("/") else value
    harness = root / "harness.py"
    harness.write_text(HARNESS)
    spec = root / "spec.json"
    spec.write_text(json.dumps({"env": env, "config_file": str(rooted(f"{etc}/jupyterhub_config.py"))}))
    p = subprocess.run(
        [sys.executable, str(harness), str(spec)], cwd=root, capture_output=True, text=True, timeout=120
    )
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"hub config harness failed:\n{p.stdout}\n{p.stderr}"
    result = json.loads(lines[-1][len("RESULT ") :])
    result["log"] = p.stdout[-3000:] + p.stderr[-3000:]
    result["root"] = str(root)
    return result


# ---------------------------------------------------------------------------------------------------------
# The checks: each returns its problems ([] is good).


def check_hub_account(docs: list[dict[str, Any]], cluster: list[dict[str, Any]]) -> list[str]:
    """The hub pod runs as ServiceAccount hub/jhub, which the chart's Role and the recipe's cluster-wide
    RBAC bind, and which the admission policy bounds."""
    problems = []
    sa = [d["metadata"] for d in find(docs, "ServiceAccount")]
    pod_sa = one(docs, "Deployment", "hub")["spec"]["template"]["spec"].get("serviceAccountName")
    if pod_sa != "hub":
        problems.append(f"the hub pod runs as ServiceAccount {pod_sa!r}, not 'hub'")
    if not any(m["name"] == pod_sa and m.get("namespace") == NS for m in sa):
        problems.append(f"no ServiceAccount {pod_sa!r} rendered in {NS}")
    hub_subject = {"kind": "ServiceAccount", "name": pod_sa, "namespace": NS}
    for b in find(cluster, "ClusterRoleBinding"):
        if b["metadata"]["name"].startswith("tfdist-hub") and b["subjects"] != [hub_subject]:
            problems.append(
                f"ClusterRoleBinding {b['metadata']['name']} binds {b['subjects']}, not {hub_subject}"
            )
    for b in find(docs, "RoleBinding", "hub"):
        if b["subjects"] != [hub_subject]:
            problems.append(f"the chart's RoleBinding hub binds {b['subjects']}, not {hub_subject}")
    # API Priority and Fairness: the hub's own schema names the account the hub pod runs as, or the hub's
    # requests fall into the tenants' level
    for fs in find(cluster, "FlowSchema", "tfdist-hub"):
        named = [s.get("serviceAccount") or {} for r in fs["spec"]["rules"] for s in r["subjects"]]
        if not any(a.get("namespace") == NS and a.get("name") in (pod_sa, "*") for a in named):
            problems.append(f"FlowSchema tfdist-hub names {named}, not {NS}/{pod_sa}")
    user = f"system:serviceaccount:{NS}:{pod_sa}"
    for pol in find(cluster, "ValidatingAdmissionPolicy"):
        if pol["metadata"]["name"].startswith("tfdist-hub-bounds"):
            conds = [m["expression"] for m in pol["spec"]["matchConditions"]]
            if not any(f"'{user}'" in e for e in conds):
                problems.append(f"the hub's admission bounds match {conds}, not {user}")
    return problems


def check_hub_config(hub: dict[str, Any]) -> list[str]:
    """What the running hub's config says about spawning."""
    if "exit" in hub:
        return [f"the hub's config does not load: {hub['exit']}\n{hub['log']}"]
    problems = []
    if hub["spawner_class"] != SPAWNER:
        problems.append(f"spawner_class is {hub['spawner_class']!r}, not {SPAWNER}")
    if hub["enable_user_namespaces"] is not True:
        problems.append(f"enable_user_namespaces is {hub['enable_user_namespaces']!r}: users share jhub")
    if "{username}" not in (hub["user_namespace_template"] or ""):
        problems.append(f"user_namespace_template {hub['user_namespace_template']!r} is not per user")
    if hub["service_account"] != NOTEBOOK_SA:
        problems.append(f"notebooks run as {hub['service_account']!r}, not {NOTEBOOK_SA}")
    if not Path(hub["profiles_file"] or "").is_file():
        problems.append(f"profiles_file {hub['profiles_file']!r} is not the mounted profiles file")
    if (hub["extra_labels"] or {}).get(HUB_ACCESS_LABEL) != "true":
        problems.append(f"notebook pods lack {HUB_ACCESS_LABEL}=true, which the hub's policy admits")
    host = (hub["hub_connect_url"] or "").split("//", 1)[-1].split(":", 1)[0].split("/", 1)[0]
    if not host.endswith(f".{NS}.svc") and f".{NS}.svc." not in host:
        problems.append(
            f"hub_connect_url {hub['hub_connect_url']!r}: not the hub's name from a user namespace"
        )
    return problems


def _security(container: dict[str, Any]) -> dict[str, Any]:
    sc = container.get("securityContext") or container.get("security_context") or {}
    caps = sc.get("capabilities") or {}
    return {
        "privileged": sc.get("privileged"),
        "add": caps.get("add") or [],
        "run_as_user": sc.get("runAsUser", sc.get("run_as_user")),
        "escalation": sc.get("allowPrivilegeEscalation", sc.get("allow_privilege_escalation")),
    }


def check_notebook_containers(hub: dict[str, Any]) -> list[str]:
    """No init or sidecar container of a notebook pod that Pod Security "restricted" refuses."""
    if "exit" in hub:
        return [f"the hub's config does not load: {hub['exit']}"]
    problems = []
    for c in hub["init_containers"] + hub["extra_containers"]:
        s = _security(c)
        if s["privileged"] or s["add"] or s["run_as_user"] == 0 or s["escalation"]:
            problems.append(f"notebook container {c.get('name')!r} is not restricted: {s}")
    return problems


def check_profiles_mount(docs: list[dict[str, Any]]) -> list[str]:
    """TFDIST_PROFILES names the path where the hub container mounts the profiles file, whose content is
    hub_config/profiles.yaml."""
    container = hub_container(docs)
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    path = env.get("TFDIST_PROFILES")
    mounts = {m["mountPath"]: m for m in container.get("volumeMounts", [])}
    if path not in mounts:
        return [f"TFDIST_PROFILES={path!r} is no mount of the hub container ({sorted(mounts)})"]
    key = mounts[path].get("subPath")
    content = secret_data(one(docs, "Secret", "hub")).get(key or "")
    if content != (REPO / PROFILES).read_text():
        return [f"the file mounted at {path} (Secret hub, key {key!r}) is not {PROFILES}"]
    return []


def check_extra_config_compiles(docs: list[dict[str, Any]]) -> list[str]:
    """Every hub.extraConfig snippet in the values the hub reads (Secret hub, values.yaml) compiles."""
    values = yaml.safe_load(secret_data(one(docs, "Secret", "hub"))["values.yaml"])
    snippets = (values.get("hub") or {}).get("extraConfig") or {}
    problems = [] if snippets else ["hub.extraConfig is empty"]
    for key, code in snippets.items():
        p = subprocess.run(
            [sys.executable, "-c", "import sys; compile(sys.stdin.read(), sys.argv[1], 'exec')", key],
            input=code,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if p.returncode:
            problems.append(f"hub.extraConfig.{key} does not compile: {p.stderr.strip().splitlines()[-1]}")
    return problems


# rbac-notebook.yaml's rules that no chart component holds in jhub (the hub's Role creates pods, Secrets and
# Services there itself)
NOTEBOOK_VERBS = {("batch", "jobs", "create"), ("networking.k8s.io", "networkpolicies", "create")}


def check_no_user_rights_in_hub_namespace(objects: list[dict[str, Any]], notebook_sa: str) -> list[str]:
    """No binding in jhub (or cluster-wide) names the notebooks' service account, a namespace's default
    one, or all service accounts; no Role in jhub carries rbac-notebook.yaml's rules; and the notebooks' SA
    is none that a chart component runs as (the hub's rights would be theirs)."""
    problems = []
    chart_sas = {
        (d["metadata"].get("namespace"), d["metadata"]["name"])
        for d in objects
        if d["kind"] == "ServiceAccount" and d["metadata"]["name"] != NOTEBOOK_SA
    }
    if (NS, notebook_sa) in chart_sas:
        problems.append(f"notebooks run as {notebook_sa!r}, a ServiceAccount of the chart in {NS}")
    for b in objects:
        if b["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        if b["kind"] == "RoleBinding" and b["metadata"].get("namespace") != NS:
            continue
        for s in b.get("subjects") or []:
            name = s.get("name", "")
            if (
                (s["kind"] == "ServiceAccount" and name in (NOTEBOOK_SA, notebook_sa, "default"))
                or (s["kind"] == "Group" and name.startswith("system:serviceaccounts"))
                or (s["kind"] in ("User", "Group") and name in ("system:authenticated", "system:anonymous"))
            ):
                problems.append(f"{b['kind']} {b['metadata']['name']} grants {s} rights in {NS}")
    for r in objects:
        if r["kind"] == "Role" and r["metadata"].get("namespace") == NS:
            granted = {
                (g, res, v)
                for rule in r.get("rules") or []
                for g in rule.get("apiGroups") or []
                for res in rule.get("resources") or []
                for v in rule.get("verbs") or []
            }
            if NOTEBOOK_VERBS & granted or any("*" in t for t in granted):
                problems.append(
                    f"Role {r['metadata']['name']} in {NS} carries notebook rules {NOTEBOOK_VERBS & granted}"
                )
    return problems


def _selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A label selector (matchLabels; matchExpressions unsupported here: never matches) on labels."""
    if selector is None:
        return True
    if selector.get("matchExpressions"):
        return False
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def admits(
    rules: list[dict[str, Any]], key: str, own_ns: str, ns: dict[str, str], pod: dict[str, str], port: Any
) -> bool:
    """Whether NetworkPolicy rules (`key` "from" or "to") admit a pod (its namespace's labels, its labels)
    on `port` (a number, or a named port given as "name/number")."""
    names = {str(x) for x in str(port).split("/")}
    for rule in rules:
        ports = {str(p.get("port")) for p in rule.get("ports") or []}
        if ports and not ports & names:
            continue
        if not rule.get(key):
            return True  # from/to anywhere
        for peer in rule[key]:
            if "ipBlock" in peer:
                continue
            if "namespaceSelector" in peer:
                ns_ok = _selects(peer["namespaceSelector"], ns)
            else:  # a podSelector alone: the policy's own namespace
                ns_ok = ns.get("kubernetes.io/metadata.name") == own_ns
            if ns_ok and _selects(peer.get("podSelector"), pod):
                return True
    return False


def tenant(hub_port: int = 8081):
    """A user namespace as the spawner makes it (its labels, the notebook ingress and default egress)."""
    from tfdist.kube import egress, tenancy

    p = tenancy.TenantPolicy(user="alice", namespace=f"{NS}-alice", hub_namespace=NS, hub_port=hub_port)
    labels = {**tenancy.namespace(p)["metadata"]["labels"], "kubernetes.io/metadata.name": p.namespace}
    return labels, tenancy.notebook_ingress(p), egress.default_egress(p)


def pod_labels(docs: list[dict[str, Any]], name: str) -> dict[str, str]:
    kind = "StatefulSet" if name == "user-placeholder" else "Deployment"
    return one(docs, kind, name)["spec"]["template"]["metadata"]["labels"]


def check_hub_ingress_from_tenants(docs: list[dict[str, Any]], notebook_labels: dict[str, str]) -> list[str]:
    """z2jh's hub NetworkPolicy admits notebook pods of the user namespaces (labelled as the spawner labels
    them) to the hub's API port."""
    pols = find(docs, "NetworkPolicy", "hub")
    if not pols:
        return []  # no policy: nothing refuses them
    ns_labels, _, _ = tenant()
    pod = {**notebook_labels, "component": "singleuser-server"}
    if admits(pols[0]["spec"].get("ingress") or [], "from", NS, ns_labels, pod, "http/8081"):
        return []
    return ["the hub's NetworkPolicy refuses notebook pods of the user namespaces (tfdist.io/tenant=true)"]


# ---------------------------------------------------------------------------------------------------------
# The recipe as shipped


@pytest.fixture(scope="module")
def rendered(helm) -> list[dict[str, Any]]:
    return render(helm)


@pytest.fixture(scope="module")
def recipe_cluster() -> list[dict[str, Any]]:
    """What the recipe applies besides the chart."""
    return [
        *recipe_rbac("admission-policy.yaml"),
        *recipe_rbac("rbac-hub-tenancy.yaml"),
        *recipe_rbac("rbac-hub-gpu-view.yaml"),
        *recipe_rbac("flowcontrol.yaml"),
    ]


@pytest.fixture(scope="module")
def hub(rendered, tmp_path_factory) -> dict[str, Any]:
    return run_hub_config(rendered, tmp_path_factory.mktemp("hubroot"))


def test_recipe_hub_account_is_the_bound_subject(rendered, recipe_cluster):
    assert check_hub_account(rendered, recipe_cluster) == []
    # the sed'd files really name hub/jhub (not a NAMESPACE left over)
    subjects = [b["subjects"] for b in find(recipe_cluster, "ClusterRoleBinding")]
    assert subjects == [[{"kind": "ServiceAccount", "name": "hub", "namespace": NS}]] * 2
    assert len(find(recipe_cluster, "FlowSchema", "tfdist-hub")) == 1


def test_recipe_hub_config_selects_tfdist_with_user_namespaces(hub):
    assert check_hub_config(hub) == []
    assert hub["spawner_class"] == SPAWNER and SPAWNER in hub["spawner_mro"]
    assert hub["enable_user_namespaces"] is True
    assert hub["service_account"] == NOTEBOOK_SA
    assert hub["hub_connect_url"] == f"http://hub.{NS}.svc:8081"
    assert "Loading extra config: tfdist" in hub["log"]
    assert hub["egress_api_server"] == []  # the admin's to fill (values.yaml says how)


def test_recipe_hub_says_its_servers_share_its_origin(hub, helm, tmp_path):
    """No subdomain_host: a user's server is on the hub's origin, where an admin who opens it runs that
    user's code as the admin. The hub says so in its log at every start; with subdomains it does not."""
    from tfdist.spawner.hubroles import SHARED_ORIGIN

    assert SHARED_ORIGIN in hub["log"]
    docs = render(helm, VALUES, "--set", "hub.config.JupyterHub.subdomain_host=https://hub.example.org")
    sub = run_hub_config(docs, tmp_path)
    assert check_hub_config(sub) == [] and SHARED_ORIGIN not in sub["log"]


def test_recipe_egress_api_server_from_helm_set(helm, tmp_path):
    """The admin's one cluster-specific setting, given as values.yaml says, reaches the spawner valid."""
    from tfdist.kube import egress

    endpoints = "10.0.0.10:6443 10.0.0.11:6443"
    docs = render(helm, VALUES, "--set", f"hub.extraEnv.TFDIST_EGRESS_API_SERVER={endpoints}")
    hub = run_hub_config(docs, tmp_path)
    assert check_hub_config(hub) == []
    assert hub["egress_api_server"] == endpoints.split()
    for text in hub["egress_api_server"]:
        egress.Endpoint.parse(text)


def test_recipe_notebook_containers_are_restricted(rendered, hub):
    assert check_notebook_containers(hub) == []
    values = yaml.safe_load(secret_data(one(rendered, "Secret", "hub"))["values.yaml"])
    assert values["singleuser"]["cloudMetadata"]["blockWithIptables"] is False


def test_recipe_profiles_mounted_where_tfdist_profiles_points(rendered, hub):
    assert check_profiles_mount(rendered) == []
    assert Path(hub["profiles_file"]).read_text() == (REPO / PROFILES).read_text()


def test_recipe_extra_config_compiles(rendered):
    assert check_extra_config_compiles(rendered) == []


def test_recipe_grants_notebooks_nothing_in_hub_namespace(rendered, recipe_cluster, hub):
    assert check_no_user_rights_in_hub_namespace(rendered + recipe_cluster, hub["service_account"]) == []
    # the only RoleBindings in jhub are the chart's, for its own components' accounts
    for b in find(rendered, "RoleBinding"):
        assert {s["name"] for s in b["subjects"]} <= {"hub", "user-scheduler"}, b


def test_recipe_hub_admits_notebooks_of_user_namespaces(rendered, hub):
    assert check_hub_ingress_from_tenants(rendered, hub["extra_labels"]) == []


def test_user_namespace_policies_fit_the_chart(rendered, hub):
    """The other ends, as the spawner writes them (tfdist.kube.tenancy/egress): a user namespace admits the
    chart's hub and proxy pods to notebooks, and its pods reach the chart's hub pod on the API port of the
    URL the notebooks get (the hub container's port)."""
    port = int(hub["hub_connect_url"].rsplit(":", 1)[1].split("/")[0])
    _, ingress, egress_policy = tenant(hub_port=port)
    jhub = {"kubernetes.io/metadata.name": NS}
    for name in ("hub", "proxy"):
        assert admits(
            ingress["spec"]["ingress"], "from", f"{NS}-alice", jhub, pod_labels(rendered, name), 8888
        )
    hub_pod = pod_labels(rendered, "hub")
    assert admits(egress_policy["spec"]["egress"], "to", f"{NS}-alice", jhub, hub_pod, port)
    assert {"name": "http", "containerPort": port} in [
        {k: p[k] for k in ("name", "containerPort")} for p in hub_container(rendered)["ports"]
    ]
    # and not the chart's other pods
    for name in ("user-scheduler", "user-placeholder"):
        assert not admits(
            egress_policy["spec"]["egress"], "to", f"{NS}-alice", jhub, pod_labels(rendered, name), port
        )


# ---------------------------------------------------------------------------------------------------------
# Each check catches a realistic mistake in a copy of values.yaml


def _set(path: str, value: Any):
    def edit(values: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = values
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value

    return edit


def _extra_config(old: str, new: str):
    def edit(values: dict[str, Any]) -> None:
        code = values["hub"]["extraConfig"]["tfdist"]
        assert old in code, old
        values["hub"]["extraConfig"]["tfdist"] = code.replace(old, new)

    return edit


def test_mistake_hub_service_account_renamed(helm, tmp_path, recipe_cluster):
    docs = render(helm, edited_values(tmp_path, _set("hub.serviceAccount.name", "jupyterhub")))
    problems = check_hub_account(docs, recipe_cluster)
    assert any("ClusterRoleBinding tfdist-hub-tenancy binds" in p for p in problems), problems
    assert any("admission bounds" in p for p in problems), problems
    # flowcontrol.yaml names every account of the hub's namespace: a renamed one stays in workload-high
    assert not any("FlowSchema" in p for p in problems), problems


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            _extra_config(f'"{SPAWNER}"', '"kubespawner.KubeSpawner"'),
            "spawner_class is 'kubespawner.KubeSpawner'",
        ),
        (
            _extra_config("enable_user_namespaces = True", "enable_user_namespaces = False"),
            "enable_user_namespaces is False",
        ),
        (_set("singleuser.serviceAccountName", "default"), "notebooks run as 'default'"),
        (_extra_config("c.JupyterHub.hub_connect_url =", "_unused ="), "'http://hub:8081'"),
        (_set("singleuser.extraLabels", {HUB_ACCESS_LABEL: None}), f"notebook pods lack {HUB_ACCESS_LABEL}"),
        (_set("hub.extraFiles.tfdist-profiles.mountPath", "/etc/tfdist/profiles.yaml"), "SystemExit(2)"),
    ],
    ids=["kubespawner", "shared-namespace", "default-sa", "short-hub-url", "no-hub-label", "profiles-moved"],
)
def test_mistake_in_hub_config(helm, tmp_path, edit, expected):
    docs = render(helm, edited_values(tmp_path, edit))
    problems = check_hub_config(run_hub_config(docs, tmp_path / "root"))
    assert any(expected in p for p in problems), problems


def test_mistake_profiles_mounted_elsewhere(helm, tmp_path):
    docs = render(
        helm, edited_values(tmp_path, _set("hub.extraFiles.tfdist-profiles.mountPath", "/etc/p.yaml"))
    )
    problems = check_profiles_mount(docs)
    assert problems and "is no mount of the hub container" in problems[0], problems


def test_mistake_profiles_key_not_the_recipe_file(helm, tmp_path):
    """A second extraFiles entry's mountPath where TFDIST_PROFILES points would shadow the profiles."""

    def edit(values):
        values["hub"]["extraFiles"]["tfdist-profiles"]["mountPath"] = "/etc/unused.yaml"
        values["hub"]["extraFiles"]["other"] = {
            "mountPath": values["hub"]["extraEnv"]["TFDIST_PROFILES"],
            "stringData": "gpu_models: {}\n",
        }

    problems = check_profiles_mount(render(helm, edited_values(tmp_path, edit)))
    assert problems and "is not hub_config/profiles.yaml" in problems[0], problems


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            _set("singleuser.cloudMetadata.blockWithIptables", True),
            "'block-cloud-metadata' is not restricted",
        ),
        (
            _set(
                "singleuser.initContainers",
                [
                    {
                        "name": "net",
                        "image": "busybox",
                        "securityContext": {"capabilities": {"add": ["NET_ADMIN"]}},
                    }
                ],
            ),
            "'net' is not restricted",
        ),
        (
            _set(
                "singleuser.extraContainers",
                [{"name": "side", "image": "x", "securityContext": {"runAsUser": 0}}],
            ),
            "'side' is not restricted",
        ),
    ],
    ids=["cloud-metadata-blocker", "init-net-admin", "root-sidecar"],
)
def test_mistake_unrestricted_notebook_container(helm, tmp_path, edit, expected):
    docs = render(helm, edited_values(tmp_path, edit))
    problems = check_notebook_containers(run_hub_config(docs, tmp_path / "root"))
    assert any(expected in p for p in problems), problems


def test_mistake_extra_config_syntax(helm, tmp_path):
    edit = _extra_config(
        "c.JupyterHub.allow_named_servers = True", "c.JupyterHub.allow_named_servers = True)"
    )
    problems = check_extra_config_compiles(render(helm, edited_values(tmp_path, edit)))
    assert problems and "hub.extraConfig.tfdist does not compile" in problems[0], problems


def test_mistake_rbac_notebook_applied_in_hub_namespace(rendered, recipe_cluster):
    """The README's warning: rbac-notebook.yaml applied in jhub (`kubectl apply -n jhub -f ...`)."""
    objects = rendered + recipe_cluster + applied_in(recipe_rbac("rbac-notebook.yaml"), NS)
    problems = check_no_user_rights_in_hub_namespace(objects, NOTEBOOK_SA)
    assert any("RoleBinding tfdist-notebook grants" in p for p in problems), problems
    assert any("Role tfdist-notebook in jhub carries notebook rules" in p for p in problems), problems


def test_mistake_notebooks_run_as_the_hub(helm, tmp_path, recipe_cluster):
    docs = render(helm, edited_values(tmp_path, _set("singleuser.serviceAccountName", "hub")))
    problems = check_no_user_rights_in_hub_namespace(docs + recipe_cluster, "hub")
    assert any("notebooks run as 'hub', a ServiceAccount of the chart" in p for p in problems), problems


@pytest.mark.parametrize(
    "edit",
    [
        _set("hub.networkPolicy.ingress", []),
        _set("hub.networkPolicy.ingress", [{"ports": [{"port": "http"}], "from": [{"podSelector": {}}]}]),
    ],
    ids=["no-rule", "own-namespace-only"],
)
def test_mistake_hub_refuses_user_namespaces(helm, tmp_path, edit, hub):
    docs = render(helm, edited_values(tmp_path, edit))
    assert check_hub_ingress_from_tenants(docs, hub["extra_labels"]) != []


def test_recipe_header_is_what_is_tested(helm):
    """The admin's recipe (values.yaml's header) installs the chart version and arguments rendered here."""
    header = "\n".join(ln for ln in (REPO / VALUES).read_text().splitlines() if ln.startswith("#"))
    command = " ".join(header.replace("\\\n#", " ").split())
    chart_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]
    assert (
        f"helm upgrade --install {RELEASE} jupyterhub/jupyterhub --version {chart_version} -n {NS}" in command
    )
    assert f"--values {VALUES}" in command
    assert f"--set-file hub.extraFiles.tfdist-profiles.stringData={PROFILES}" in command
    for name in ("rbac-hub-tenancy.yaml", "rbac-hub-gpu-view.yaml"):
        assert f"sed 's/NAMESPACE/{NS}/' hub_config/{name} | kubectl apply -f -" in command
    assert "kubectl apply -f hub_config/admission-policy.yaml" in command


# ------------------------------------------------------------- versions: the `hub` extra and z2jh's hub image

HUB_IMAGE_REQUIREMENTS = CHART.parent / "images" / "hub" / "requirements.txt"
HUB_LOCK = REPO / "docker" / "hub.lock"


def _pins(text: str) -> dict[str, str]:
    """name (normalized) -> version of a requirements file's `name==version` lines."""
    from packaging.utils import canonicalize_name

    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out[canonicalize_name(name)] = version.strip()
    return out


def check_extra_keeps_image_pins(extra: list[str], image: dict[str, str], lock: dict[str, str]) -> list[str]:
    """What `pip install jupyter-tfdist[hub]` on z2jh's hub image would upgrade (the extra refuses a pinned
    version), and which of the image's pins the hub image built here (docker/hub.lock) does not keep."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    problems = []
    for spec in extra:
        req = Requirement(spec)
        name = canonicalize_name(req.name)
        if name in image and not req.specifier.contains(image[name], prereleases=True):
            problems.append(f"the hub extra's {spec} refuses z2jh's {name}=={image[name]}")
    for name, version in image.items():
        if name in ("psycopg2",):  # left out on purpose (docker/hub.lock says why)
            continue
        if lock.get(name) != version:
            problems.append(f"docker/hub.lock has {name}=={lock.get(name)}, z2jh's hub image {version}")
    return problems


def _hub_extra() -> list[str]:
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["hub"]


def test_hub_extra_takes_z2jh_hub_image_as_it_is():
    """JupyterHub 5.5 / kubespawner 7.0 of z2jh 4.4's hub image satisfy the extra: the admin's
    `FROM k8s-hub:4.4.0` + `pip install jupyter-tfdist[hub]` upgrades nothing under z2jh's config."""
    if not HUB_IMAGE_REQUIREMENTS.is_file():
        _missing(f"z2jh's hub image recipe is missing at {HUB_IMAGE_REQUIREMENTS}")
    image = _pins(HUB_IMAGE_REQUIREMENTS.read_text())
    assert image["jupyterhub"].startswith("5.5.")
    assert check_extra_keeps_image_pins(_hub_extra(), image, _pins(HUB_LOCK.read_text())) == []


def test_mistake_hub_extra_pins_jupyterhub_6():
    if not HUB_IMAGE_REQUIREMENTS.is_file():
        _missing(f"z2jh's hub image recipe is missing at {HUB_IMAGE_REQUIREMENTS}")
    image = _pins(HUB_IMAGE_REQUIREMENTS.read_text())
    extra = [s if not s.startswith("jupyterhub>") else "jupyterhub>=6.1,<7" for s in _hub_extra()]
    lock = {**_pins(HUB_LOCK.read_text()), "jupyterhub": "6.1.1"}
    problems = check_extra_keeps_image_pins(extra, image, lock)
    assert problems == [
        "the hub extra's jupyterhub>=6.1,<7 refuses z2jh's jupyterhub==5.5.0",
        "docker/hub.lock has jupyterhub==6.1.1, z2jh's hub image 5.5.0",
    ], problems


# -------------------------------------------- the one-machine cluster: only images built there are started


def pod_images(docs: list[dict[str, Any]]) -> set[str]:
    """Every container and init container image of the rendered workloads."""
    out = set()
    for d in docs:
        spec = d.get("spec", {})
        pod = spec.get("template", {}).get("spec") if d["kind"] != "Pod" else spec
        for c in (pod or {}).get("containers", []) + (pod or {}).get("initContainers", []):
            out.add(c["image"])
    return out


def _machine_values(tmp_path: Path, edit=None) -> Path:
    from tests.realnode_z2jh import Images, local_values

    images = Images(*(f"localhost/tfdist-{n}:{n}-0123456789ab" for n in ("hub", "proxy", "notebook", "job")))
    values = local_values(images, ["10.99.0.1:6443"], "p" * 16, "a" * 43)
    if edit:
        edit(values)
    out = tmp_path / "machine.yaml"
    out.write_text(yaml.safe_dump(values))
    return out


def test_machine_values_start_only_images_built_here(helm, tmp_path):
    """scripts/cluster hub's values over the recipe: nothing the chart starts comes from quay.io or
    registry.k8s.io (machines here cannot pull), and none is pulled."""
    docs = render(helm, VALUES, "--values", str(_machine_values(tmp_path)))
    assert pod_images(docs) == {
        "localhost/tfdist-hub:hub-0123456789ab",
        "localhost/tfdist-proxy:proxy-0123456789ab",
    }
    for d in docs:
        pod = d.get("spec", {}).get("template", {}).get("spec") or {}
        for c in pod.get("containers", []):
            assert c.get("imagePullPolicy") == "Never", (d["metadata"]["name"], c["name"])


def test_mistake_machine_values_keep_the_user_scheduler(helm, tmp_path):
    def edit(v):
        v["scheduling"]["userScheduler"]["enabled"] = True

    docs = render(helm, VALUES, "--values", str(_machine_values(tmp_path, edit)))
    assert any(i.startswith("registry.k8s.io/kube-scheduler") for i in pod_images(docs))
