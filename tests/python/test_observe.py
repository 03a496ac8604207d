"""What a worker can see of its client: its counters (Client.stats()), and
its log lines, which go to stderr at TALLY_LOG_LEVEL, never into the
training script's stdout. Against a real pool (conftest.py)."""

import os
import subprocess
import sys

import torch

from conftest import connect, new_job, on_every_rank


def test_stats_count_the_ops_bytes_and_times(pool):
    clients = connect(pool.address, new_job("stats"), 2)
    before = clients[0].stats()
    assert before["ops_completed"] == 0 and before["bytes_sent"] == 0

    def run(rank, client):
        for _ in range(5):
            client.allreduce(torch.ones(1000))

    on_every_rank(clients, run)
    for c in clients:
        s = c.stats()
        assert s["ops_completed"] == 5 and s["ops_failed"] == 0, s
        assert s["bytes_sent"] == s["bytes_received"] == 5 * 4000, s
        assert s["reconnects"] == 0 and s["replays"] == 0, s
        bounds = [b for b, _ in s["op_seconds_buckets"]]
        assert bounds == sorted(bounds) and bounds[-1] == float("inf"), bounds
        assert sum(n for _, n in s["op_seconds_buckets"]) == 5
        assert 0 < s["op_seconds_p50"] <= s["op_seconds_p99"] <= max(s["op_seconds_max"], 1e-4)
        assert 0 < s["op_seconds_max"] <= s["op_seconds_sum"]
        c.close()


# A worker whose results do not fit TALLY_RESUME_BYTES logs a warning once:
# a line the client itself writes, after it connected.
SCRIPT = """
import sys, torch, tally
c = tally.Client(pool=sys.argv[1], job=sys.argv[2], rank=0, world_size=1, resume_bytes=64)
c.allreduce(torch.ones(1024))
print("done", c.stats()["ops_completed"])
c.close()
"""


def run_worker(pool, job, **env):
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, pool.address, job],
        env=dict(os.environ, **env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def test_log_lines_go_to_stderr_at_tally_log_level(pool):
    r = run_worker(pool, new_job("log-info"))
    assert r.stdout == "done 1\n", r.stdout  # the script's own output, nothing else
    assert "is not kept for a reducer restart" in r.stderr, r.stderr
    r = run_worker(pool, new_job("log-error"), TALLY_LOG_LEVEL="error")
    assert r.stdout == "done 1\n", r.stdout
    assert "is not kept" not in r.stderr, r.stderr
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, pool.address, new_job("log-typo")],
        env=dict(os.environ, TALLY_LOG_LEVEL="warnig"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0
    assert "TALLY_LOG_LEVEL: 'warnig' is not a log level (trace, debug, info, warn" in r.stderr
