"""A PEP 517 build backend for the `tally` package (pyproject.toml).

It configures this repository with CMake for the interpreter running the
build (sys.executable), builds only the `tally_python` target (libtally and
the pybind11 module, no tests, no reducer), and zips the package laid out in
<build>/python/tally into a wheel. No setuptools or PyPI package is needed.

The build tree is $TALLY_PIP_BUILD_DIR, else build/pip-<python tag> in the
checkout, kept between installs so a second install only relinks.
"""

import base64
import hashlib
import os
import re
import subprocess
import sys
import sysconfig
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAME = "tally"


def _version():
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        return re.search(r"project\(tally VERSION ([0-9.]+)", f.read()).group(1)


def _tags():
    python = "cp%d%d" % sys.version_info[:2]
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    return python, python, platform


def _build():
    python_tag = "%s-%s-%s" % _tags()
    build_dir = os.environ.get("TALLY_PIP_BUILD_DIR") or os.path.join(ROOT, "build", "pip-" + python_tag)
    if not os.path.exists(os.path.join(build_dir, "build.ninja")):
        subprocess.check_call([
            "cmake", "-S", ROOT, "-B", build_dir, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
            "-DTALLY_BUILD_TESTS=OFF", "-DTALLY_BUILD_PYTHON=ON",
            "-DPython_EXECUTABLE=" + sys.executable,
        ], stdout=sys.stderr)
    subprocess.check_call(["cmake", "--build", build_dir, "--target", "tally_python", "--",
                           "-j%d" % (os.cpu_count() or 1)], stdout=sys.stderr)
    return os.path.join(build_dir, "python", NAME)


def _record_line(path, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return "%s,sha256=%s,%d" % (path, digest, len(data))


def _metadata(version):
    return ("Metadata-Version: 2.1\nName: %s\nVersion: %s\n"
            "Summary: Client of the tally reduction server: all-reduce and a PyTorch DDP "
            "communication hook\nRequires-Python: >=3.9\n" % (NAME, version))


def get_requires_for_build_wheel(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    info = "%s-%s.dist-info" % (NAME, _version())
    os.makedirs(os.path.join(metadata_directory, info), exist_ok=True)
    with open(os.path.join(metadata_directory, info, "METADATA"), "w") as f:
        f.write(_metadata(_version()))
    return info


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    version = _version()
    package_dir = _build()
    tag = "%s-%s-%s" % _tags()
    wheel_name = "%s-%s-%s.whl" % (NAME, version, tag)
    info = "%s-%s.dist-info" % (NAME, version)
    records = []
    with zipfile.ZipFile(os.path.join(wheel_directory, wheel_name), "w", zipfile.ZIP_DEFLATED) as whl:
        def add(arcname, data):
            whl.writestr(arcname, data)
            records.append(_record_line(arcname, data))

        for entry in sorted(os.listdir(package_dir)):
            if entry.endswith(".py") or (entry.startswith("_core") and entry.endswith(".so")):
                with open(os.path.join(package_dir, entry), "rb") as f:
                    add("%s/%s" % (NAME, entry), f.read())
        add(info + "/METADATA", _metadata(version).encode())
        add(info + "/WHEEL", ("Wheel-Version: 1.0\nGenerator: tally_build\nRoot-Is-Purelib: false\n"
                              "Tag: %s\n" % tag).encode())
        records.append(info + "/RECORD,,")
        whl.writestr(info + "/RECORD", "\n".join(records) + "\n")
    return wheel_name
