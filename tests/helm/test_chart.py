"""Checks of helm/tally with the real helm binary (deploy/fetch-helm.sh).

Renders the chart under the three values files in helm/tally/ci/ and checks
the objects: names and ports agree across Service, StatefulSet, probes and
NOTES.txt; the objects validate against the Kubernetes API schemas
(kubernetes-models, offline); the pod's command starts a pool of real tally-reducer processes
(adapted to loopback) that answers /readyz; the schema and the template
checks refuse bad values with a clear message. The alerting rules pass
promtool's check and unit tests, and every metric the rules and the
dashboard query is served by a live reducer.

Environment: TALLY_HELM (the helm binary; default build/tools/helm, fetched
if missing), TALLY_REDUCER (tally-reducer, for the start-up and metric
tests).
"""
import base64
import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request

import pytest
import yaml

from chart import (
    CHART,
    NAMESPACE,
    RELEASE,
    VALUES,
    notes,
    reducer_script,
    render,
    run_helm,
    statefulset,
    values_of,
)


@pytest.mark.parametrize("values", VALUES, ids=os.path.basename)
def test_lint_strict(helm, values):
    r = run_helm(helm, "lint", "--strict", CHART, "-f", values)
    assert "0 chart(s) failed" in r.stdout


@pytest.mark.parametrize("values", VALUES, ids=os.path.basename)
def test_names_ports_and_probes_agree(helm, values):
    v = values_of(values)
    objs = render(helm, values)
    sts = statefulset(objs)
    name = sts["metadata"]["name"]
    svc = objs[("Service", name)]
    assert sts["spec"]["serviceName"] == name
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    assert sts["spec"]["replicas"] == v["shards"] * v["groups"]
    # The Service selects exactly the StatefulSet's pods.
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert all(pod_labels.get(k) == val for k, val in svc["spec"]["selector"].items())
    assert sts["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"]
    c = sts["spec"]["template"]["spec"]["containers"][0]
    container_ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert container_ports == {"tally": v["port"], "http": v["httpPort"]}
    svc_ports = {p["name"]: (p["port"], p["targetPort"]) for p in svc["spec"]["ports"]}
    assert svc_ports == {"tally": (v["port"], "tally"), "http": (v["httpPort"], "http")}
    for probe, path in (
        ("livenessProbe", "/healthz"),
        ("readinessProbe", "/readyz"),
        ("startupProbe", "/healthz"),
    ):
        get = c[probe]["httpGet"]
        assert get["path"] == path
        port = get["port"]
        assert container_ports.get(port, port) == v["httpPort"], probe
    script = reducer_script(sts)
    assert f"--listen 0.0.0.0:{v['port']}" in script
    assert f"--http-listen 0.0.0.0:{v['httpPort']}" in script
    ann = sts["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/port"] == str(v["httpPort"])
    # Memory: the budget plus the overhead, as plain integers (no 4.294967296e+09).
    mem = str(v["memoryBudgetBytes"] + v["memoryOverheadBytes"])
    assert c["resources"]["requests"]["memory"] == mem
    assert c["resources"]["limits"]["memory"] == mem
    assert f"--memory-budget {v['memoryBudgetBytes']} " in script + " "
    assert "e+" not in json.dumps(list(objs.values()))
    pdb = objs.get(("PodDisruptionBudget", name))
    assert (pdb is not None) == v["podDisruptionBudget"]["enabled"]
    if pdb:
        assert pdb["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"]
    nps = objs.get(("NetworkPolicy", name))
    assert (nps is not None) == v["networkPolicy"]["enabled"]
    if nps:
        ports = [p["port"] for rule in nps["spec"]["ingress"] for p in rule["ports"]]
        assert sorted(ports) == ["http", "tally"]  # named: they follow the container's ports
    sm = objs.get(("ServiceMonitor", name))
    assert (sm is not None) == v["serviceMonitor"]["enabled"]
    if sm:
        assert sm["spec"]["endpoints"][0]["port"] == "http"
        assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
        assert sm["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"]
    spec = sts["spec"]["template"]["spec"]
    anti = spec.get("affinity", {}).get("podAntiAffinity", {})
    if v["podAntiAffinity"] == "hard":
        assert "requiredDuringSchedulingIgnoredDuringExecution" in anti
    elif v["podAntiAffinity"] == "soft":
        assert "preferredDuringSchedulingIgnoredDuringExecution" in anti
    else:
        assert not anti
    assert spec.get("priorityClassName", "") == v["priorityClassName"]
    assert spec.get("nodeSelector", {}) == v["nodeSelector"]
    assert spec.get("tolerations", []) == v["tolerations"]
    assert spec["securityContext"]["runAsNonRoot"] is True


@pytest.mark.parametrize("values", VALUES, ids=os.path.basename)
def test_notes_pool_matches_the_statefulset_and_service(helm, values):
    v = values_of(values)
    objs = render(helm, values)
    sts = statefulset(objs)
    name = sts["metadata"]["name"]
    text = notes(helm, values)
    n = v["shards"] * v["groups"]
    pool = f"{name}-{{0..{n - 1}}}.{name}.{NAMESPACE}.svc.{v['clusterDomain']}:{v['port']}"
    assert f"TALLY_POOL={pool}\n" in text, text
    assert f"TALLY_GROUPS={v['groups']}\n" in text, text
    assert ("TALLY_TRANSPORT=fabric" in text) == (v["transport"] == "fabric")
    # The reducers are given the same pool, and the workers' ConfigMap too.
    assert f"--pool '{pool}'" in reducer_script(sts)
    workers = objs[("ConfigMap", f"{name}-workers")]["data"]
    assert workers["TALLY_POOL"] == pool
    assert workers["TALLY_GROUPS"] == str(v["groups"])
    assert workers.get("TALLY_TRANSPORT") == ("fabric" if v["transport"] == "fabric" else None)
    assert f"ConfigMap {name}-workers" in text, text
    # Pod names <statefulset>-<ordinal> under the Service's domain are what
    # the pattern expands to.
    assert objs[("Service", name)]["metadata"]["name"] == name
    # The notes say how workers get the pool's Secret: the one given, or
    # the one generated for the release.
    secret = v.get("auth", {}).get("existingSecret", "") or f"{name}-auth"
    assert "WARNING" not in text, text
    assert f"Secret {secret} in the workers and set TALLY_JOB_SECRET_FILE" in text, text


def test_auth_mounts_the_secret_and_requires_it(helm):
    objs = render(helm, sets=["auth.existingSecret=tally-auth", "groups=2"])
    sts = statefulset(objs)
    script = reducer_script(sts)
    assert (
        "--job-secret-file /etc/tally/auth/job-secret --require-auth --pool-secret-file /etc/tally/auth/pool-secret"
        in script
    )
    pod = sts["spec"]["template"]["spec"]
    (volume,) = pod["volumes"]
    assert volume["secret"]["secretName"] == "tally-auth"
    assert [i["key"] for i in volume["secret"]["items"]] == ["job-secret", "pool-secret"]
    assert volume["secret"]["defaultMode"] == 0o440 and pod["securityContext"]["fsGroup"] == 10001
    assert pod["containers"][0]["volumeMounts"] == [
        {"name": "auth", "mountPath": "/etc/tally/auth", "readOnly": True}
    ]
    # One group: no pool secret; require off: the job secret only.
    script = reducer_script(
        statefulset(render(helm, sets=["auth.existingSecret=s", "auth.require=false"]))
    )
    assert "--job-secret-file /etc/tally/auth/job-secret" in script
    assert "--require-auth" not in script and "--pool-secret-file" not in script
    # No secret and none generated: none of it, and protected mode unless
    # told otherwise.
    sts = statefulset(render(helm, sets=["auth.generate=false"]))
    assert "secret" not in reducer_script(sts) and "volumes" not in sts["spec"]["template"]["spec"]
    assert "--insecure-open-pool" not in reducer_script(sts)
    sts = statefulset(render(helm, sets=["auth.generate=false", "auth.insecureOpenPool=true"]))
    assert "--insecure-open-pool" in reducer_script(sts)


def test_the_network_policy_is_on_by_default_and_admits_the_namespace(helm):
    objs = render(helm)
    (np,) = [o for (k, _), o in objs.items() if k == "NetworkPolicy"]
    data, http = np["spec"]["ingress"]
    pool_pods, test_pod, workers = data["from"]
    assert all("namespaceSelector" not in p for p in (pool_pods, test_pod, workers))
    assert test_pod["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "test"
    assert workers["podSelector"] == {}  # the release's namespace only
    (scrapers,) = http["from"]
    assert scrapers["namespaceSelector"] == {} and scrapers["podSelector"] == {}  # any namespace
    assert not any(
        k == "NetworkPolicy" for k, _ in render(helm, sets=["networkPolicy.enabled=false"])
    )


def test_notes_warn_of_a_pool_without_a_secret(helm):
    text = notes(helm, sets=["auth.generate=false"])
    assert "serve loopback only and refuse every worker of another pod" in text, text
    text = notes(helm, sets=["auth.generate=false", "auth.insecureOpenPool=true"])
    assert "a stranger can join a job, read its results and change" in text, text


def test_by_default_the_chart_generates_the_pools_secret_and_requires_it(helm):
    objs = render(helm, sets=["groups=2"])
    secret = objs[("Secret", f"{RELEASE}-tally-auth")]
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    keys = {k: base64.b64decode(v) for k, v in secret["data"].items()}
    assert sorted(keys) == ["job-secret", "pool-secret"]
    assert all(len(v) == 48 for v in keys.values()) and keys["job-secret"] != keys["pool-secret"]
    sts = statefulset(objs)
    script = reducer_script(sts)
    assert "--job-secret-file /etc/tally/auth/job-secret --require-auth" in script
    assert "--pool-secret-file /etc/tally/auth/pool-secret" in script
    (volume,) = sts["spec"]["template"]["spec"]["volumes"]
    assert volume["secret"]["secretName"] == f"{RELEASE}-tally-auth"
    assert f"Secret {RELEASE}-tally-auth in the workers" in notes(helm, sets=["groups=2"])
    # An existing Secret: none generated.
    assert not any(k == "Secret" for k, _ in render(helm, sets=["auth.existingSecret=s"]))


@pytest.mark.parametrize("kubernetes", ["kubernetes-1.27", "kubernetes-1.34"])
@pytest.mark.parametrize("values", VALUES, ids=os.path.basename)
def test_objects_validate_against_the_kubernetes_schemas(helm, values, kubernetes):
    """Offline, with the npm package kubernetes-models of two Kubernetes
    versions (types and required fields; it does not report unknown fields).
    The helm test pod is among the objects."""
    models = os.path.join(os.path.dirname(helm), "k8s", "node_modules")
    if not shutil.which("node") or not os.path.isdir(os.path.join(models, kubernetes)):
        pytest.skip(f"node or {kubernetes} (deploy/fetch-helm.sh puts it in {models}) is missing")
    objs = list(render(helm, values).values())
    r = subprocess.run(
        [
            "node",
            os.path.join(os.path.dirname(__file__), "validate_k8s.js"),
            os.path.join(models, kubernetes),
        ],
        input=json.dumps(objs),
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, NODE_PATH=models),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    for kind, name in render(helm, values):
        if kind not in ("ServiceMonitor", "PrometheusRule"):  # CRDs: not in kubernetes-models
            assert f"valid {kind}/{name}" in r.stdout, r.stdout


def test_schema_rejects_a_negative_shard_count(helm):
    r = run_helm(helm, "template", RELEASE, CHART, "--set", "shards=-1", check=False)
    assert r.returncode != 0
    assert "shards: Must be greater than or equal to 1" in r.stderr, r.stderr
    r = run_helm(helm, "lint", "--strict", CHART, "--set", "shards=-1", check=False)
    assert r.returncode != 0, r.stdout


@pytest.mark.parametrize(
    "bad,message",
    [
        ("groups=0", "groups: Must be greater than or equal to 1"),
        ("maxChunkBytes=5000", "maxChunkBytes: Must be a multiple of 4096"),
        ("transport=udp", "transport: transport must be one of the following"),
        ("window=0", "window: Must be greater than or equal to 1"),
        ("podAntiAffinity=maybe", "podAntiAffinity: podAntiAffinity must be one of the following"),
        ("linkRate=25G", "linkRate: Does not match pattern"),
    ],
)
def test_schema_rejects_bad_values(helm, bad, message):
    r = run_helm(helm, "template", RELEASE, CHART, "--set", bad, check=False)
    assert r.returncode != 0
    assert message in r.stderr, r.stderr


def test_a_memory_budget_below_one_window_is_refused(helm):
    # 8 MiB holds 2 buffers of 4 MiB; a job needs window 8 + 2 = 10.
    r = run_helm(
        helm, "template", RELEASE, CHART, "--set", "memoryBudgetBytes=8388608", check=False
    )
    assert r.returncode != 0
    assert (
        "memoryBudgetBytes=8388608 holds 2 chunk buffers of maxChunkBytes=4194304, but one job needs 10"
        in r.stderr
    ), r.stderr
    assert "at least 41943040" in r.stderr
    # With 3 groups a job needs window x (1 + 2F) + 2 = 8 x 7 + 2 = 58 buffers.
    r = run_helm(
        helm,
        "template",
        RELEASE,
        CHART,
        "--set",
        "groups=3",
        "--set",
        "memoryBudgetBytes=209715200",
        check=False,
    )
    assert r.returncode != 0
    assert "one job needs 58" in r.stderr, r.stderr
    # The smallest budget that holds one job renders.
    run_helm(helm, "template", RELEASE, CHART, "--set", "memoryBudgetBytes=41943040")


def test_an_overhead_below_the_streams_bound_is_refused(helm):
    # Outside its budget a reducer holds up to 16 MiB + 32 MiB per I/O thread + 80 KiB per stream.
    r = run_helm(helm, "template", RELEASE, CHART, "--set", "maxConnections=4096", check=False)
    assert r.returncode != 0
    assert (
        "memoryOverheadBytes=268435456 is below what a reducer may hold outside its budget with "
        "maxConnections=4096: 16 MiB + 32 MiB per I/O thread (ioThreads=2) + 80 KiB per stream "
        "= 419430400" in r.stderr
    ), r.stderr
    objs = render(helm, sets=["maxConnections=4096", "memoryOverheadBytes=419430400"])
    assert "--max-connections 4096" in reducer_script(statefulset(objs))
    assert "--max-connections 2048" in reducer_script(statefulset(render(helm)))
    # A fabric pool's endpoints take 72 MiB per I/O thread besides.
    r = run_helm(helm, "template", RELEASE, CHART, "--set", "transport=fabric", check=False)
    assert r.returncode != 0
    assert (
        "80 KiB per stream + 72 MiB per I/O thread for the fabric endpoints = 402653184" in r.stderr
    ), r.stderr


def test_a_link_rate_paces_the_reducers_and_tells_the_workers(helm):
    assert "--link-rate" not in reducer_script(statefulset(render(helm)))
    assert "TALLY_LINK_RATE" not in notes(helm)
    assert "--link-rate '25gbit'" in reducer_script(
        statefulset(render(helm, sets=["linkRate=25gbit"]))
    )
    text = notes(helm, sets=["linkRate=25gbit"])
    assert "TALLY_LINK_RATE=<the workers' link rate, e.g. 25gbit>" in text, text


def test_the_receive_budget_reaches_the_reducers(helm):
    assert "--receive-budget 524288 " in reducer_script(statefulset(render(helm)))
    script = reducer_script(statefulset(render(helm, sets=["receiveBudgetBytes=2097152"])))
    assert "--receive-budget 2097152 " in script


def test_large_integers_render_as_integers(helm):
    objs = render(helm, sets=["memoryBudgetBytes=68719476736"])  # 64 GiB
    script = reducer_script(statefulset(objs))
    assert "--memory-budget 68719476736 " in script
    assert "e+" not in script


MONITORING = os.path.join(CHART, "monitoring")
ALERTS = os.path.join(MONITORING, "alerts.yaml")
DASHBOARD = os.path.join(MONITORING, "dashboard.json")


def test_prometheus_rule_and_dashboard_carry_the_checked_files(helm):
    objs = render(helm)
    assert not any(k in ("PrometheusRule",) for k, _ in objs), "off by default"
    objs = render(
        helm,
        sets=["prometheusRule.enabled=true", "grafanaDashboard.enabled=true"],
    )
    (rule,) = [o for (k, _), o in objs.items() if k == "PrometheusRule"]
    with open(ALERTS) as f:
        assert rule["spec"] == yaml.safe_load(f)
    cm = objs[("ConfigMap", f"{RELEASE}-tally-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    with open(DASHBOARD) as f:
        assert json.loads(cm["data"]["tally.json"]) == json.load(f)


def promtool():
    path = shutil.which("promtool")
    assert path, "promtool is missing (Debian's prometheus package; deploy/dev.sh setup)"
    return path


def test_alert_rules_pass_promtool_check_and_unit_tests():
    for args in (
        ["check", "rules", ALERTS],
        ["test", "rules", os.path.join(os.path.dirname(__file__), "alerts_test.yaml")],
    ):
        r = subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"promtool {' '.join(args)}:\n{r.stdout}{r.stderr}"


def queried_series():
    """(metric, {label: value}) for every series selector in the alert rules
    and the dashboard's queries."""
    with open(ALERTS) as f:
        exprs = [r["expr"] for g in yaml.safe_load(f)["groups"] for r in g["rules"]]
    with open(DASHBOARD) as f:
        exprs += [t["expr"] for p in json.load(f)["panels"] for t in p["targets"]]
    assert exprs
    found = []
    for e in exprs:
        for m in re.finditer(r"\b((?:tally|process)_[a-z0-9_]+)(\{[^}]*\})?", e):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            found.append((m.group(1), labels))
    return found


def test_every_metric_the_alerts_and_dashboard_query_is_on_a_live_reducer(tmp_path):
    reducer = os.environ.get("TALLY_REDUCER")
    if not reducer or not os.access(reducer, os.X_OK):
        pytest.skip("TALLY_REDUCER is not set to a tally-reducer binary")
    ready = tmp_path / "ready"
    p = subprocess.Popen(
        [reducer, "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"]
        + ["--ready-file", str(ready), "--log-level", "warn"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while not (ready.exists() and len(ready.read_text().splitlines()) >= 2):
            assert p.poll() is None, "tally-reducer exited"
            assert time.monotonic() < deadline, "tally-reducer did not get ready"
            time.sleep(0.05)
        http = ready.read_text().splitlines()[1].split()[1]
        with urllib.request.urlopen(f"http://{http}/metrics", timeout=5) as r:
            text = r.read().decode()
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)
    families = {}  # name -> type
    samples = []  # (name, {label: value})
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            families[name] = kind
        elif line and not line.startswith("#"):
            m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?", line)
            samples.append((m.group(1), dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))))
    for name, labels in queried_series():
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in families or families.get(base) == "histogram", f"{name} is not served"
        if labels:
            assert any(
                n == name and all(have.get(k) == v for k, v in labels.items())
                for n, have in samples
            ), f"no {name} sample has {labels}"
