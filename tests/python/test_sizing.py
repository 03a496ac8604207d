"""bench/sizing.py: the sizing model's terms against their closed forms, the
planner's search, and the check of tally-bench --json runs."""

import json
import math
import os
import subprocess
import sys

import pytest

sys.path.insert(
    0,
    os.path.join(os.environ.get("TALLY_SOURCE_DIR", os.path.dirname(__file__) + "/../.."), "bench"),
)
import sizing  # noqa: E402

GBIT = 1e9
MIB = 1 << 20
# No CPU and no per-op time: the links alone.
WIRE_ONLY = sizing.Costs(0.0, 0.0, 0.0, 0.0, 0.0, 1.0)


def test_units():
    assert sizing.parse_rate("1gbit") == 1e9
    assert sizing.parse_rate("25000mbit") == 25e9
    assert sizing.parse_size("64M") == 64 * MIB
    assert sizing.parse_size("4096") == 4096
    for bad in ("1gb", "fast"):
        with pytest.raises(ValueError):
            sizing.parse_rate(bad)
    with pytest.raises(ValueError):
        sizing.parse_size("1T")


@pytest.mark.parametrize("workers,shards", [(4, 4), (8, 4), (12, 8), (2, 1), (64, 16)])
def test_links_alone_give_the_bound_g_s_over_w(workers, shards):
    pool = sizing.Pool(workers, shards, 1, GBIT)
    p = sizing.predict(pool, WIRE_ONLY, 64 * MIB)
    line = GBIT / 8 / 1e9
    assert p.algbw_gbps == pytest.approx(line * min(1.0, shards / workers))
    assert p.bound == ("worker link" if shards >= workers else "reducer link")
    assert p.reducer_bytes == pytest.approx(workers / shards * 64 * MIB)


def test_replica_exchange_is_the_butterflys_bytes():
    # Power-of-two groups: 2(G-1)/G x N_s each way (docs/architecture.md, Traffic).
    assert sizing.replica_bytes(1, 1000) == 0
    assert sizing.replica_bytes(2, 1000) == pytest.approx(1000)
    assert sizing.replica_bytes(4, 1000) == pytest.approx(1500)
    pool = sizing.Pool(8, 2, 2, GBIT)
    p = sizing.predict(pool, WIRE_ONLY, 16 * MIB)
    # Each reducer: 4 workers x 8 MiB plus 8 MiB with its replica.
    assert p.reducer_bytes == pytest.approx(5 * 8 * MIB)


def test_shared_cores_add_every_process_cpu():
    costs = sizing.Costs(1.0, 2.0, 0.0, 0.0, 0.0)
    pool = sizing.Pool(4, 2, 1, 1e15, shared_cores=2)  # links never bind
    n = 1e9
    p = sizing.predict(pool, costs, n)
    # 4 workers x 1 s + 2 reducers x 2 s/GB x 2 GB, over 2 cores.
    assert p.bound == "shared cpu"
    assert p.seconds == pytest.approx((4 * 1.0 + 2 * 2.0 * 2) / 2)


def test_reducer_cpu_spreads_over_its_cores_up_to_its_streams():
    costs = sizing.Costs(0.0, 1.0, 0.0, 0.0, 0.0)
    fast = 1e15
    n = 1e9
    two = sizing.predict(sizing.Pool(4, 1, 1, fast, reducer_cores=2), costs, n)
    eight = sizing.predict(sizing.Pool(4, 1, 1, fast, reducer_cores=8), costs, n)
    assert two.seconds == pytest.approx(4 / 2)
    assert eight.seconds == pytest.approx(4 / 4)  # 4 streams: 4 cores at most
    assert two.reducer_cores_busy == pytest.approx(2.0)


def test_plan_finds_the_fewest_reducers_for_the_target():
    shards, cores, p, _ = sizing.plan(64, 100 * GBIT, 64 * MIB, WIRE_ONLY, target=0.9)
    # W/S <= 1/0.9 first holds at S = 58.
    assert shards == math.ceil(0.9 * 64)
    assert p.algbw_gbps >= 0.9 * 100 / 8
    costs = sizing.Costs(0.0, 0.5, 0.0, 0.0, 0.0)
    shards, cores, p, _ = sizing.plan(8, 100 * GBIT, 64 * MIB, costs, target=0.9)
    # The links first need S = W = 8 (7 reducers reach 7/8 of the link);
    # then 12.5 GB/s into a reducer at 0.5 s/GB is 6.25 cores, 0.9 of it 6.
    assert (shards, cores) == (8, 6)
    assert p.algbw_gbps >= 0.9 * 100 / 8


def test_the_ring_pays_its_steps():
    costs = sizing.Costs(0.0, 0.0, 0.0, 0.0, 1e-3)
    ring = sizing.predict_ring(4, 1e15, costs, 1e6)
    assert ring == pytest.approx(1e6 / (2 * 3 * 1e-3) / 1e9, rel=1e-4)


def test_the_ring_is_faster_below_half_as_many_reducers_as_workers():
    # Links alone: a ring moves 2(W-1)/W x N per worker, a pool W/S x N per
    # reducer, so the pool is as fast from S = W / (2(W-1)/W) on.
    costs = sizing.Costs(0.0, 0.0, 0.0, 0.0, 0.0, 1.0)
    assert sizing.ring_crossover(64, GBIT, 64 * MIB, costs, 2) == math.ceil(64 / (2 * 63 / 64))
    assert sizing.ring_crossover(2, GBIT, 64 * MIB, costs, 2) == 2


def _run(workers, shards, rows):
    return {
        "workers": workers,
        "shards": shards,
        "groups": 1,
        "rows": [{"size": s, "algbw_gbps": a} for s, a in rows],
    }


def test_check_compares_each_row_at_or_above_the_smallest_size(tmp_path):
    costs = sizing.Costs()
    pool = sizing.Pool(8, 4, 1, GBIT, shared_cores=2)
    model = sizing.predict(pool, costs, 16 * MIB).algbw_gbps
    doc = _run(8, 4, [(4096, 1.0), (16 * MIB, model * 1.1)])
    rows = sizing.check(doc, GBIT, costs, 2, MIB)
    assert [r[0] for r in rows] == [16 * MIB]
    assert rows[0][3] == pytest.approx(1.1)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(doc))
    out = subprocess.run(
        [
            sys.executable,
            sizing.__file__,
            "check",
            "--link",
            "1gbit",
            "--shared-cores",
            "2",
            str(path),
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "1.10x" in out and "worst: 10% off" in out


def test_the_command_line_predicts_and_plans():
    run = [sys.executable, sizing.__file__]
    out = subprocess.run(
        run + ["predict", "-W", "8", "-S", "4", "--link", "1gbit", "--size", "16M"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "W=8 S=4 G=1" in out and "bound by the reducer link" in out
    out = subprocess.run(
        run + ["plan", "-W", "64", "--link", "25gbit"], check=True, capture_output=True, text=True
    ).stdout
    assert "reducers of" in out
    bad = subprocess.run(
        run + ["plan", "-W", "4", "--link", "fast"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "link rate 'fast'" in bad.stderr
