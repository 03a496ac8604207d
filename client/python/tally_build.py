"""A PEP 517 build backend for the `tally` package (pyproject.toml).

The package is pure Python over libtally_c.so (ctypes), so one wheel serves
every CPython from 3.9 and every torch: it is tagged py3-none-<platform>.
The backend builds libtally_c.so and tally-reducer with this repository's
CMake (every build links them for the wheel: the library finds its
neighbours through an RPATH of $ORIGIN, the reducer through
$ORIGIN/../_lib) and zips:

    tally/*.py
    tally/_lib/libtally_c.so and every library it or the reducer links that
        is not the C runtime (glibc, libstdc++, libgcc_s), as `ldd` finds them
    tally/_bin/tally-reducer, run by the console script `tally-reducer`

No setuptools or PyPI package is needed. The build tree is
$TALLY_PIP_BUILD_DIR, else build/pip-wheel in the checkout (configured for
Release on first use), kept between builds so a second one only relinks.
$TALLY_PIP_BUILD_DIR may name any configured build tree of the checkout
(build/, say): its two targets are brought up to date as it is configured.
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
SUMMARY = (
    "Client of the tally reduction server: all-reduce, a PyTorch DDP communication hook "
    "and a torch.distributed backend"
)
# Libraries every Linux with a glibc at least as new as the build's has, and
# that must be the process's own (torch's libstdc++ is the one loaded).
SYSTEM = re.compile(
    r"^(linux-vdso|ld-linux|libc|libm|libdl|libpthread|librt|libresolv|libutil|"
    r"libstdc\+\+|libgcc_s)[.-]"
)


def _version():
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        return re.search(r"project\(tally VERSION ([0-9.]+)", f.read()).group(1)


def _tag():
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    return "py3-none-" + platform


def _build():
    build_dir = os.environ.get("TALLY_PIP_BUILD_DIR") or os.path.join(ROOT, "build", "pip-wheel")
    if not os.path.exists(os.path.join(build_dir, "build.ninja")):
        subprocess.check_call(
            [
                "cmake",
                "-S",
                ROOT,
                "-B",
                build_dir,
                "-G",
                "Ninja",
                "-DCMAKE_BUILD_TYPE=Release",
                "-DTALLY_BUILD_TESTS=OFF",
                "-DTALLY_BUILD_PYTHON=OFF",
            ],
            stdout=sys.stderr,
        )
    subprocess.check_call(
        [
            "cmake",
            "--build",
            build_dir,
            "--target",
            "tally_c",
            "tally-reducer",
            "--",
            "-j%d" % (os.cpu_count() or 1),
        ],
        stdout=sys.stderr,
    )
    return (
        os.path.join(build_dir, "client", "libtally_c.so"),
        os.path.join(build_dir, "reducer", "tally-reducer"),
    )


def _dependencies(*binaries):
    """{soname: path} of what the binaries link, the C runtime aside."""
    found = {}
    for binary in binaries:
        out = subprocess.check_output(["ldd", binary], text=True)
        for line in out.splitlines():
            m = re.match(r"\s*(\S+) => (\S+) \(", line)
            if not m:
                continue
            soname, path = m.groups()
            if path == "not":
                raise RuntimeError(
                    "%s: %s is not found (install the build's dependencies: "
                    "deploy/dev.sh setup)" % (binary, soname)
                )
            if not SYSTEM.match(soname):
                found[soname] = os.path.realpath(path)
    return found


def _record_line(path, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return "%s,sha256=%s,%d" % (path, digest, len(data))


def _metadata(version):
    return "Metadata-Version: 2.1\nName: %s\nVersion: %s\nSummary: %s\nRequires-Python: >=3.9\n" % (
        NAME,
        version,
        SUMMARY,
    )


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
    library, reducer = _build()
    tag = _tag()
    wheel_name = "%s-%s-%s.whl" % (NAME, version, tag)
    info = "%s-%s.dist-info" % (NAME, version)
    sources = os.path.join(ROOT, "client", "python", NAME)
    records = []
    with zipfile.ZipFile(
        os.path.join(wheel_directory, wheel_name), "w", zipfile.ZIP_DEFLATED
    ) as whl:

        def add(arcname, data, executable=False):
            entry = zipfile.ZipInfo(arcname, date_time=(2020, 1, 1, 0, 0, 0))
            entry.compress_type = zipfile.ZIP_DEFLATED
            # A regular file's mode, which pip reads for the executable bit.
            entry.external_attr = (0o100755 if executable else 0o100644) << 16
            whl.writestr(entry, data)
            records.append(_record_line(arcname, data))

        def add_file(arcname, path, executable=False):
            with open(path, "rb") as f:
                add(arcname, f.read(), executable)

        for entry in sorted(os.listdir(sources)):
            if entry.endswith(".py"):
                add_file("%s/%s" % (NAME, entry), os.path.join(sources, entry))
        add_file("%s/_lib/libtally_c.so" % NAME, library)
        for soname, path in sorted(_dependencies(library, reducer).items()):
            add_file("%s/_lib/%s" % (NAME, soname), path)
        add_file("%s/_bin/tally-reducer" % NAME, reducer, executable=True)
        add(info + "/METADATA", _metadata(version).encode())
        add(
            info + "/WHEEL",
            (
                "Wheel-Version: 1.0\nGenerator: tally_build\nRoot-Is-Purelib: false\n"
                "Tag: %s\n" % tag
            ).encode(),
        )
        add(
            info + "/entry_points.txt",
            b"[console_scripts]\ntally-reducer = tally._cli:reducer_main\n",
        )
        records.append(info + "/RECORD,,")
        whl.writestr(info + "/RECORD", "\n".join(records) + "\n")
    return wheel_name
