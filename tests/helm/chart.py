"""What the chart checks share: rendering the chart into objects with the
real helm (conftest.py's fixture), NOTES.txt as helm renders it, and the
reducer's pod spec."""
import os
import shutil
import subprocess
import tempfile

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHART = os.path.join(ROOT, "helm", "tally")
VALUES = sorted(os.path.join(CHART, "ci", f) for f in os.listdir(os.path.join(CHART, "ci")))
NAMESPACE = "ml"
RELEASE = "pool"


def run_helm(helm, *args, check=True):
    r = subprocess.run([helm, *args], capture_output=True, text=True, timeout=60)
    if check:
        assert r.returncode == 0, f"helm {' '.join(args)}:\n{r.stdout}\n{r.stderr}"
    return r


def render(helm, values=None, sets=(), chart=CHART):
    args = ["template", RELEASE, chart, "--namespace", NAMESPACE]
    if values:
        args += ["-f", values]
    for s in sets:
        args += ["--set", s]
    docs = [d for d in yaml.safe_load_all(run_helm(helm, *args).stdout) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def notes(helm, values=None, sets=()):
    """NOTES.txt as a user sees it, rendered by helm's own engine: helm
    template skips NOTES.txt, so a copy of the chart renders it through
    `tpl` into a ConfigMap."""
    with tempfile.TemporaryDirectory() as tmp:
        chart = os.path.join(tmp, "tally")
        shutil.copytree(CHART, chart)
        os.makedirs(os.path.join(chart, "notes"))
        shutil.copy(
            os.path.join(chart, "templates", "NOTES.txt"), os.path.join(chart, "notes", "NOTES.txt")
        )
        with open(os.path.join(chart, "templates", "zz-notes.yaml"), "w") as f:
            f.write(
                "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\n"
                'data:\n  notes: {{ tpl (.Files.Get "notes/NOTES.txt") . | quote }}\n'
            )
        return render(helm, values, sets, chart=chart)[("ConfigMap", "notes")]["data"]["notes"]


def values_of(path):
    with open(os.path.join(CHART, "values.yaml")) as f:
        v = yaml.safe_load(f)
    with open(path) as f:
        v.update(yaml.safe_load(f) or {})
    return v


def statefulset(objs):
    (sts,) = [o for (k, _), o in objs.items() if k == "StatefulSet"]
    return sts


def reducer_script(sts):
    c = sts["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["/bin/sh", "-c"]
    return c["args"][0]
