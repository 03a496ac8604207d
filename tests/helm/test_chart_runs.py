"""The chart's commands, run: the StatefulSet's command starts a pool of real
tally-reducer processes (moved to loopback) that gets ready, and the helm
test pod's command (tally-bench) all-reduces against that pool.

Environment: TALLY_HELM (conftest.py), TALLY_REDUCER and TALLY_BENCH (the
binaries the image carries); without the binaries the tests skip.
"""
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request

import pytest

from chart import NAMESPACE, VALUES, reducer_script, render, statefulset, values_of


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(port, host, path):
    try:
        with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=2) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return None, str(e)


@pytest.mark.parametrize("values", [p for p in VALUES if "fabric" not in p], ids=os.path.basename)
def test_pod_command_starts_a_pool_that_gets_ready(helm, values, tmp_path):
    """Runs the StatefulSet's command for every ordinal, as the pods would,
    with only the addresses moved to loopback: pod i listens on 127.0.0.(i+1)
    and the pool's DNS names become those addresses. Then `helm test`'s pod
    command all-reduces against it."""
    reducer, bench = os.environ.get("TALLY_REDUCER"), os.environ.get("TALLY_BENCH")
    if not all(b and os.access(b, os.X_OK) for b in (reducer, bench)):
        pytest.skip("TALLY_REDUCER and TALLY_BENCH are not set to tally-reducer and tally-bench")
    v = values_of(values)
    port, http = free_port(), free_port()
    budget = 64 << 20
    chunk = 1 << 20  # small enough for a test machine, still valid for the chart
    objs = render(
        helm,
        values,
        sets=[
            f"port={port}",
            f"httpPort={http}",
            f"memoryBudgetBytes={budget}",
            f"maxChunkBytes={chunk}",
            "window=2",
            "logLevel=info",
        ],
    )
    sts = statefulset(objs)
    name = sts["metadata"]["name"]
    n = sts["spec"]["replicas"]
    script = reducer_script(sts)
    dns = f"{name}-{{0..{n - 1}}}.{name}.{NAMESPACE}.svc.{v['clusterDomain']}:{port}"
    assert dns in script
    # The Secret's mount, as kubelet would fill it.
    auth = tmp_path / "auth"
    auth.mkdir()
    (auth / "job-secret").write_text("job-" + "j" * 32)
    (auth / "pool-secret").write_text("pool-" + "p" * 32)
    for name in ("job-secret", "pool-secret"):  # the chart's defaultMode, our own group
        os.chmod(auth / name, 0o440)
    script = script.replace("/etc/tally/auth/", f"{auth}/")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    os.symlink(os.path.abspath(reducer), bindir / "tally-reducer")
    os.symlink(os.path.abspath(bench), bindir / "tally-bench")
    procs = []
    try:
        for i in range(n):
            local = script.replace("0.0.0.0", f"127.0.0.{i + 1}").replace(
                dns, f"127.0.0.{{1..{n}}}:{port}"
            )
            env = dict(os.environ, HOSTNAME=f"{name}-{i}", PATH=f"{bindir}:{os.environ['PATH']}")
            log = open(tmp_path / f"reducer-{i}.log", "w")
            procs.append(
                subprocess.Popen(["/bin/sh", "-c", local], env=env, stderr=log, stdout=log)
            )
        deadline = time.monotonic() + 20
        pending = set(range(n))
        while pending and time.monotonic() < deadline:
            for i in list(pending):
                assert procs[i].poll() is None, (tmp_path / f"reducer-{i}.log").read_text()
                status, _ = http_get(http, f"127.0.0.{i + 1}", "/readyz")
                if status == 200:
                    pending.discard(i)
            time.sleep(0.1)
        assert not pending, {i: http_get(http, f"127.0.0.{i + 1}", "/readyz") for i in pending}
        for i in range(n):
            status, text = http_get(http, f"127.0.0.{i + 1}", "/metrics")
            assert status == 200
            info = re.search(
                r'tally_reducer_info\{[^}]*shard="(\d+)",shards="(\d+)",group="(\d+)",groups="(\d+)"',
                text,
            )
            assert info, text[:500]
            assert tuple(map(int, info.groups())) == (
                i % v["shards"],
                v["shards"],
                i // v["shards"],
                v["groups"],
            )
            links = re.search(r"^tally_replica_links_up (\S+)$", text, re.M)
            assert float(links.group(1)) == v["groups"] - 1
            log = (tmp_path / f"reducer-{i}.log").read_text()
            # Every values file has a Secret (given or generated), required.
            assert "authentication is not required" not in log, log
            assert "protected mode" not in log and "insecure" not in log, log
        run_the_test_pod(objs, dns, f"127.0.0.{{1..{n}}}:{port}", auth, bindir, tmp_path)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                assert p.wait(timeout=10) == 0
            except subprocess.TimeoutExpired:
                p.kill()
                raise


def run_the_test_pod(objs, dns, local_pool, auth, bindir, tmp_path):
    """The helm test pod's command and environment, as the kubelet would run
    them, with the pool's DNS names and the Secret's mount moved here."""
    pods = [o for (k, _), o in objs.items() if k == "Pod"]
    (pod,) = pods
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (c,) = pod["spec"]["containers"]
    assert dns in c["command"]
    command = [local_pool if a == dns else a for a in c["command"]]
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}")
    for e in c["env"]:
        env[e["name"]] = e["value"].replace("/etc/tally/auth/", f"{auth}/")
    env["TMPDIR"] = str(tmp_path)
    assert env["TALLY_JOB_SECRET_FILE"] == f"{auth}/job-secret"
    r = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    # One row of the bench table: 1 MiB, every element checked, 0 wrong.
    assert re.search(r"^\s*1048576\s+262144\s+float\s+sum\s.*\s0$", r.stdout, re.M), r.stdout
