"""The package as a user gets it: `pip wheel .` from the checkout, the wheel
installed into a fresh venv, and the Python tests run from outside the
source tree with that venv's interpreter: no PYTHONPATH, no TALLY_REDUCER,
no TALLY_LIBRARY, so the package's own libtally_c.so and its own
tally-reducer (the console script) do everything. Then the same wheel
under every other CPython from 3.9 this machine has (pyenv's)."""

import glob
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

SOURCE = os.environ.get("TALLY_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
HERE = os.path.dirname(os.path.abspath(__file__))
# The tests that need only the package (train_ddp.py is an example of the checkout).
TESTS = [
    "conftest.py",
    "test_allreduce.py",
    "test_async.py",
    "test_backend.py",
    "test_errors.py",
    "test_staging.py",
]


def clean_env():
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "TALLY_REDUCER", "TALLY_LIBRARY")
    }
    binary = os.environ.get("TALLY_BINARY_DIR")
    if binary:  # the CTest build tree's own libtally_c.so and reducer: nothing to compile
        env["TALLY_PIP_BUILD_DIR"] = binary
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-build-isolation",
            "--no-deps",
            "--no-index",
            "-w",
            str(out),
            SOURCE,
        ],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    wheels = glob.glob(str(out / "tally-*-py3-none-*.whl"))
    assert len(wheels) == 1, os.listdir(out)
    return wheels[0]


def make_venv(python, where, wheel, system_site_packages):
    args = [python, "-m", "venv", str(where)]
    if system_site_packages:
        args.append("--system-site-packages")  # Debian's torch, numpy and pytest
    r = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    pip = [str(where / "bin" / "python"), "-m", "pip", "install", "--no-deps", "--no-index", wheel]
    r = subprocess.run(pip, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return where / "bin" / "python"


def test_the_wheel_in_a_venv_passes_the_tests_outside_the_tree(tmp_path, wheel):
    python = make_venv(sys.executable, tmp_path / "venv", wheel, system_site_packages=True)
    tests = tmp_path / "tests"
    tests.mkdir()
    for name in TESTS:
        shutil.copy(os.path.join(HERE, name), tests / name)
    env = clean_env()
    env["PATH"] = str(python.parent) + os.pathsep + env.get("PATH", "")
    probe = "import tally, tally.pool; print(tally.__file__); print(tally.pool.find_reducer())"
    r = subprocess.run(
        [str(python), "-c", probe],
        cwd=str(tests),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    where, reducer = r.stdout.split()
    assert where.startswith(str(tmp_path / "venv")), where
    assert reducer.startswith(str(tmp_path / "venv")), reducer
    r = subprocess.run(
        [str(python.parent / "tally-reducer"), "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and "--listen" in r.stdout, r.stdout + r.stderr
    r = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)],
        cwd=str(tests),
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and " failed" not in r.stdout, r.stdout[-2000:]


def other_pythons():
    """CPython interpreters from 3.9 on other than this one, found on this
    machine (pyenv's, and python3 on PATH), one per version."""
    here = os.path.realpath(sys.executable)
    candidates = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/*/bin/python3")))
    candidates.append(shutil.which("python3") or "")
    by_version = {}
    for c in candidates:
        if not c or os.path.realpath(c) == here or not os.access(c, os.X_OK):
            continue
        r = subprocess.run(
            [c, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        version = r.stdout.strip()
        if r.returncode == 0 and tuple(map(int, version.split("."))) >= (3, 9):
            by_version.setdefault(version, c)
    return by_version


def test_the_same_wheel_under_every_other_cpython(tmp_path, wheel):
    pythons = other_pythons()
    if not pythons:
        pytest.skip("no other CPython from 3.9 on this machine")
    # No numpy, no torch there: the buffer protocol of the standard library.
    probe = textwrap.dedent(
        """
        import array, sys, tally, tally.pool
        with tally.pool.LocalPool(shards=2, args=["--log-level", "warn"]) as p:
            with tally.Client(pool=p.address, job="other-python", rank=0, world_size=1,
                              env=False) as c:
                a = array.array("f", [1.0, 2.0, 3.0])
                c.allreduce(a, op="avg")
                print("ok %d.%d" % sys.version_info[:2], tally.__version__, a.tolist())
    """
    )
    for version, interpreter in sorted(pythons.items()):
        python = make_venv(
            interpreter, tmp_path / ("venv-" + version), wheel, system_site_packages=False
        )
        r = subprocess.run(
            [str(python), "-c", probe],
            cwd=str(tmp_path),
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, version + ": " + r.stdout + r.stderr
        assert "ok " + version in r.stdout and "[1.0, 2.0, 3.0]" in r.stdout, r.stdout
        print("the wheel under CPython", version, "from", interpreter)
