"""The values an operator adapts the chart with: resources passed through
whole, security contexts, extra env, flags and volumes, topology spread, the
ServiceAccount, name overrides, the helm test pod, and a schema that refuses
keys it does not know."""
import os
import subprocess

import pytest

from chart import CHART, RELEASE, VALUES, notes, reducer_script, render, run_helm, statefulset


def pod_spec(objs):
    return statefulset(objs)["spec"]["template"]["spec"]


def reducer(objs):
    return pod_spec(objs)["containers"][0]


def test_resources_pass_through_whole_with_memory_from_the_budget(helm):
    efa = [
        "resources.requests.cpu=8",
        "resources.requests.vpc\\.amazonaws\\.com/efa=2",
        "resources.limits.vpc\\.amazonaws\\.com/efa=2",
        "resources.limits.hugepages-2Mi=1Gi",
        "memoryBudgetBytes=536870912",
        "memoryOverheadBytes=268435456",
    ]
    r = reducer(render(helm, sets=efa))["resources"]
    assert r["requests"] == {"cpu": 8, "vpc.amazonaws.com/efa": 2, "memory": "805306368"}
    assert r["limits"] == {
        "cpu": "4",
        "vpc.amazonaws.com/efa": 2,
        "hugepages-2Mi": "1Gi",
        "memory": "805306368",
    }
    bad = run_helm(
        helm, "template", RELEASE, CHART, "--set", "resources.limits.memory=1Gi", check=False
    )
    assert bad.returncode != 0
    assert "resources.limits.memory is derived from the budget" in bad.stderr, bad.stderr


def test_security_contexts_default_as_before_and_take_ipc_lock(helm):
    spec = pod_spec(render(helm))
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == 10001
    c = spec["containers"][0]["securityContext"]
    assert c["capabilities"] == {"drop": ["ALL"]} and c["readOnlyRootFilesystem"] is True
    (fabric,) = [v for v in VALUES if "fabric" in v]
    c = reducer(render(helm, fabric))["securityContext"]
    assert c["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}


def test_extra_env_volumes_and_spread_are_rendered(helm):
    (groups,) = [v for v in VALUES if "groups" in v]
    objs = render(helm, groups)
    spec, c = pod_spec(objs), reducer(objs)
    assert {"name": "MALLOC_ARENA_MAX", "value": "2"} in c["env"]
    assert {"name": "hugepages", "mountPath": "/hugepages"} in c["volumeMounts"]
    assert any(m["name"] == "auth" for m in c["volumeMounts"])  # kept beside the extra one
    assert {"name": "hugepages", "emptyDir": {"medium": "HugePages-2Mi"}} in spec["volumes"]
    (spread,) = spec["topologySpreadConstraints"]
    assert spread["topologyKey"] == "topology.kubernetes.io/zone"
    assert "env" not in reducer(render(helm))


def test_extra_args_reach_the_reducer_word_for_word(helm, tmp_path):
    """The pod's sh -c line, with tally-reducer replaced by a program that
    prints its arguments: each extra flag arrives as one word, quotes and
    spaces included."""
    args = ["--log-level", "debug", "it's a 'word'", "$HOME", "a;b"]
    sets = [f"extraArgs[{i}]={a}" for i, a in enumerate(args)]
    script = reducer_script(statefulset(render(helm, sets=sets)))
    fake = tmp_path / "tally-reducer"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    fake.chmod(0o755)
    env = dict(os.environ, HOSTNAME="pool-tally-1", PATH=f"{tmp_path}:{os.environ['PATH']}")
    out = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    words = out.stdout.split("\n")[:-1]
    assert words[-len(args) :] == args, words
    assert words[words.index("--shard") + 1] == "1"


def test_the_service_account_mounts_no_token(helm):
    objs = render(helm)
    sa = objs[("ServiceAccount", f"{RELEASE}-tally")]
    assert sa["automountServiceAccountToken"] is False
    spec = pod_spec(objs)
    assert spec["serviceAccountName"] == f"{RELEASE}-tally"
    assert spec["automountServiceAccountToken"] is False
    (fabric,) = [v for v in VALUES if "fabric" in v]
    objs = render(helm, fabric)
    assert not any(k == "ServiceAccount" for k, _ in objs)
    assert pod_spec(objs)["serviceAccountName"] == "ml-workloads"


def test_name_overrides_rename_every_object_and_label(helm):
    objs = render(helm, sets=["nameOverride=reducers"])
    names = {name for _, name in objs}
    assert f"{RELEASE}-reducers" in names and f"{RELEASE}-reducers-workers" in names
    sts = statefulset(objs)
    assert sts["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] == "reducers"
    workers = objs[("ConfigMap", f"{RELEASE}-reducers-workers")]["data"]["TALLY_POOL"]
    assert workers.startswith(f"{RELEASE}-reducers-{{0..1}}.{RELEASE}-reducers.")
    objs = render(helm, sets=["fullnameOverride=grad-pool"])
    assert {name for _, name in objs} >= {"grad-pool", "grad-pool-workers", "grad-pool-auth"}
    assert "--pool 'grad-pool-{0..1}.grad-pool." in reducer_script(statefulset(objs))


def test_helm_test_runs_one_allreduce_with_the_pools_secret(helm):
    objs = render(helm)
    pod = objs[("Pod", f"{RELEASE}-tally-test-allreduce")]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    # Not a reducer: neither the StatefulSet nor the Service selects it.
    labels = pod["metadata"]["labels"]
    assert labels["app.kubernetes.io/component"] == "test"
    (c,) = pod["spec"]["containers"]
    assert c["command"][:3] == [
        "tally-bench",
        "--pool",
        reducer_script(statefulset(objs)).split("--pool '")[1].split("'")[0],
    ]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["TALLY_JOB_SECRET_FILE"] == "/etc/tally/auth/job-secret"
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert not any(k == "Pod" for k, _ in render(helm, sets=["tests.enabled=false"]))


@pytest.mark.parametrize(
    "bad,message",
    [
        ("shard=4", "Additional property shard is not allowed"),
        ("auth.requre=true", "Additional property requre is not allowed"),
        ("image.registry=x", "Additional property registry is not allowed"),
        ("networkPolicy.worker.podSelector.a=b", "Additional property worker is not allowed"),
        ("resources.request.cpu=1", "Additional property request is not allowed"),
        ("extraArgs=--shard", "extraArgs: Invalid type"),
    ],
)
def test_the_schema_refuses_keys_it_does_not_know(helm, bad, message):
    r = run_helm(helm, "template", RELEASE, CHART, "--set", bad, check=False)
    assert r.returncode != 0
    assert message in r.stderr, r.stderr


def test_per_job_secrets_turn_the_job_secret_into_a_master(helm):
    script = reducer_script(statefulset(render(helm, sets=["auth.perJobSecrets=true"])))
    assert (
        "--job-secret-file /etc/tally/auth/job-secret" in script and "--per-job-secrets" in script
    )
    assert "--per-job-secrets" not in reducer_script(statefulset(render(helm)))
    text = notes(helm, sets=["auth.perJobSecrets=true"])
    assert "--print-job-secret JOB" in text, text
