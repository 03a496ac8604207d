"""`pip install .` of the package from the checkout, as a user runs it with
Debian's interpreter, into a temporary --target; then the installed module
is imported from there and all-reduces against a real reducer."""

import os
import subprocess
import sys
import textwrap

SOURCE = os.environ.get("TALLY_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))


def test_pip_install_builds_and_imports(tmp_path):
    target = tmp_path / "site"
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # only what pip installed
    # Reuse one build tree across runs (client targets only), kept in the CTest build tree.
    binary = os.environ.get("TALLY_BINARY_DIR")
    if binary:
        env["TALLY_PIP_BUILD_DIR"] = os.path.join(binary, "pip-build")
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index",
         "--target", str(target), SOURCE],
        env=env, capture_output=True, text=True, timeout=840)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert (target / "tally" / "__init__.py").exists()
    probe = textwrap.dedent("""
        import sys, numpy, tally, tally.pool
        assert tally.__file__.startswith(sys.argv[1]), tally.__file__
        with tally.pool.LocalPool(shards=1, args=["--log-level", "warn"]) as p:
            with tally.Client(pool=p.address, job="installed", rank=0, world_size=1, env=False) as c:
                a = numpy.arange(5, dtype=numpy.float32)
                c.allreduce(a, op="avg")
                print("ok", tally.__version__, a.tolist())
    """)
    r = subprocess.run([sys.executable, "-c", probe, str(target)], cwd=str(tmp_path),
                       env=dict(env, PYTHONPATH=str(target)), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok 0.1.0 [0.0, 1.0, 2.0, 3.0, 4.0]" in r.stdout
