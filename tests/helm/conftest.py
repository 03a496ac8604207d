"""The chart checks' fixture: the real helm binary (deploy/fetch-helm.sh)."""
import os
import subprocess

import pytest

from chart import ROOT


@pytest.fixture(scope="session")
def helm():
    path = os.environ.get("TALLY_HELM") or os.path.join(ROOT, "build", "tools", "helm")
    if not os.access(path, os.X_OK):
        r = subprocess.run(
            [os.path.join(ROOT, "deploy", "fetch-helm.sh"), os.path.dirname(path)],
            capture_output=True,
            text=True,
            timeout=400,
        )
        if r.returncode != 0 or not os.access(path, os.X_OK):
            pytest.skip(f"helm is not available and could not be fetched: {r.stderr.strip()}")
    return path
