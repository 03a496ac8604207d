"""examples/train_ddp.py for real: W=4 processes, DDP, a few steps under the
tally hook (directly, and through the staging pipeline of CUDA buckets),
under the "tally" process group, and under gloo, with the same seed: the
parameters must agree within float tolerance. A reducer SIGKILLed mid-training and restarted at
its address must not change that; one that does not come back must surface
as a Python exception from backward(), once the workers stop reconnecting
(the op timeout)."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import tally.pool

EXAMPLE = os.path.join(
    os.environ.get("TALLY_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", "..")),
    "examples",
    "train_ddp.py",
)
SMALL = [
    "--world-size",
    "4",
    "--batch-size",
    "64",
    "--hidden",
    "64",
    "--features",
    "16",
    "--bucket-cap-mb",
    "0.01",
]  # several buckets: several ops per step


def run_example(args, timeout=240):
    return subprocess.run(
        [sys.executable, EXAMPLE] + args, capture_output=True, text=True, timeout=timeout
    )


def start_training(pool, args):
    """train_ddp.py with `args` against `pool`, returned once step 3 is printed."""
    proc = subprocess.Popen(
        [sys.executable, EXAMPLE] + SMALL + args + ["--pool", pool.address],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        for line in proc.stdout:  # training is under way once step 3 is printed
            if line.startswith("step   3"):
                return proc
            assert time.monotonic() < deadline, "no progress"
        raise AssertionError("training ended before step 3: " + proc.stderr.read())
    except BaseException:
        proc.kill()
        proc.wait()
        raise


# Parameters after training with tally and with gloo differ by summation
# order only: about 1e-7 relative after 8 steps here (every rank's gradient
# summed in another order). A corrupted bucket (a piece averaged twice, a
# result of another op) moves them by 1e-3 and more. The tolerance sits
# between the two.
RTOL, ATOL = 1e-5, 1e-6


def assert_same_parameters(ours, theirs):
    """Every parameter within RTOL/ATOL of gloo's; the message names the largest difference."""
    assert ours.keys() == theirs.keys()
    worst, where = 0.0, None
    for name in theirs:
        excess = ((ours[name] - theirs[name]).abs() - RTOL * theirs[name].abs()).max().item()
        if where is None or excess > worst:
            diff = (ours[name] - theirs[name]).abs()
            i = int(diff.argmax())
            worst, where = excess, (name, diff.max().item(), theirs[name].flatten()[i].item())
    name, largest, value = where
    assert worst <= ATOL, (
        "parameters differ from gloo's beyond summation order: %s by %.3g "
        "(gloo's value %.6g; tolerance rtol %g, atol %g)" % (name, largest, value, RTOL, ATOL)
    )


@pytest.fixture(scope="module")
def gloo_params(tmp_path_factory):
    """Parameters after 5 steps with gloo, and the losses it printed."""
    out = tmp_path_factory.mktemp("gloo") / "gloo.pt"
    r = run_example(SMALL + ["--steps", "5", "--backend", "gloo", "--save-params", str(out)])
    assert r.returncode == 0, r.stdout + r.stderr
    return torch.load(out)


@pytest.mark.parametrize(
    "mode",
    [
        ["--backend", "tally"],
        # The CUDA buckets' pipeline (tally.staging), with host buffers standing for the device.
        ["--backend", "tally", "--stage-host"],
        # init_process_group("tally"): DDP's own all-reduce through the pool, no hook.
        ["--backend", "tally-pg"],
    ],
    ids=["hook", "hook-staged", "process-group"],
)
def test_tally_trains_to_the_same_parameters_as_gloo(tmp_path, gloo_params, mode):
    out = tmp_path / "tally.pt"
    r = run_example(SMALL + ["--steps", "5", "--save-params", str(out)] + mode)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "mean_loss   4" in r.stdout, r.stdout
    assert_same_parameters(torch.load(out), gloo_params)


def test_training_survives_a_reducer_restart_with_gloos_parameters(tmp_path):
    steps = ["--steps", "8"]
    gloo = tmp_path / "gloo.pt"
    r = run_example(SMALL + steps + ["--backend", "gloo", "--save-params", str(gloo)])
    assert r.returncode == 0, r.stdout + r.stderr
    out = tmp_path / "tally.pt"
    with tally.pool.LocalPool(shards=2, args=["--log-level", "info"]) as pool:
        proc = start_training(pool, steps + ["--save-params", str(out)])
        try:
            pool.restart(1)
            rest, err = proc.communicate(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 0, rest + err
        assert "resumed" in pool.log(1), pool.log(1)
    assert_same_parameters(torch.load(out), torch.load(gloo))


def test_killed_reducer_that_does_not_come_back_raises_from_backward(tmp_path):
    op_timeout_ms = 5000
    with tally.pool.LocalPool(shards=2, args=["--log-level", "warn"]) as pool:
        proc = start_training(pool, ["--steps", "100000", "--op-timeout-ms", str(op_timeout_ms)])
        try:
            pool.kill(1, signal.SIGKILL)
            killed_at = time.monotonic()
            _, err = proc.communicate(timeout=op_timeout_ms / 1000 + 60)
            exited_after = time.monotonic() - killed_at
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 1, err
    print(err)
    assert "PeerLostError: lost reducer" in err, err
    assert "lost reducer %s (shard 1)" % pool.addresses[1] in err, err
    # Each rank reports how long its failing step took.
    failed = [line for line in err.splitlines() if " failed at step " in line]
    assert failed, err
    # The workers reconnect for the op timeout, then give up.
    for line in failed:
        seconds = float(line.split(" after ")[1].split(" s:")[0])
        assert seconds < op_timeout_ms / 1000 + 5, line
    assert exited_after < op_timeout_ms / 1000 + 30
