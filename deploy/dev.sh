#!/usr/bin/env bash
# tally's one entry point for people and CI on a Debian 12 machine:
#   deploy/dev.sh bench [tally-bench flags]   set up, build, run a local pool + 4 workers, print the table and the comparison with Gloo and MPI
#   deploy/dev.sh test                        set up, build, run every test (plain, ASan+UBSan, TSan, then the fuzz targets; python tests in the plain build)
#   deploy/dev.sh setup | build               the steps on their own
#   deploy/dev.sh format | check-format       clang-format and black the tree in place, or only check it (and pyflakes)
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  libboost-dev protobuf-compiler libprotobuf-dev libspdlog-dev libfmt-dev libcli11-dev nlohmann-json3-dev
  libgtest-dev libgmock-dev libbenchmark-dev clang-format
  # Python's formatter and linter (pyproject.toml's [tool.black]).
  black pyflakes3
  libfabric-dev libfabric-bin iproute2
  # The fuzz targets (tests/fuzz): clang and its libFuzzer runtime.
  clang libclang-rt-14-dev
  # HMAC-SHA256 challenge-response for jobs and replica links.
  libssl-dev
  # The Python module, the DDP hook and their tests: Debian's torch is seen by
  # /usr/bin/python3 only; pip builds the package with setuptools + CMake.
  python3-torch python3-numpy python3-pytest
  python3-pip python3-setuptools python3-wheel python3-venv
  # Metrics over HTTP; the chart checks (python3-yaml, helm unzipped from npm).
  prometheus-cpp-dev python3-yaml unzip
  # promtool, which checks and unit-tests the chart's alerting rules.
  prometheus
  # tally-bench --compare's peers: Gloo (PyTorch's CPU all-reduce) and Open MPI.
  libgloo-dev openmpi-bin libopenmpi-dev
)

# How long apt waits for another apt or dpkg (e.g. unattended-upgrades on a
# fresh machine) to release its lock before giving up.
APT_LOCK_WAIT_S=${APT_LOCK_WAIT_S:-600}

# apt_get ARGS...: apt-get, waiting (bounded) while another process holds
# the dpkg or apt lists lock instead of failing at once.
apt_get() {
  local deadline=$((SECONDS + APT_LOCK_WAIT_S)) err
  err=$(mktemp)
  until $sudo apt-get -o DPkg::Lock::Timeout=30 "$@" 2>"$err"; do
    if grep -qE "Could not get lock|Unable to acquire|is another process using it" "$err" &&
      ((SECONDS < deadline)); then
      echo "dev.sh: apt is busy (another apt or dpkg holds its lock); waiting" >&2
      sleep 5
    else
      cat "$err" >&2
      rm -f "$err"
      return 1
    fi
  done
  rm -f "$err"
}

setup() {
  local missing=()
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    echo "dev.sh: installing ${missing[*]}" >&2
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    apt_get update -qq
    DEBIAN_FRONTEND=noninteractive apt_get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

# build DIR [cmake args...]: configure once, then build incrementally.
# BUILD_TARGETS, if set, limits what is built.
build() {
  local dir=$1
  shift
  if [ ! -f "$dir/build.ninja" ]; then
    # /usr/bin/python3: the interpreter that sees Debian's torch (a pyenv
    # python3 may come first on PATH).
    cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPython_EXECUTABLE=/usr/bin/python3 "$@" >/dev/null
  fi
  # shellcheck disable=SC2086
  cmake --build "$dir" ${BUILD_TARGETS:+--target $BUILD_TARGETS} -- -j"$(nproc)"
}

# run_tests DIR [ctest args...]
run_tests() {
  local dir=$1
  shift
  echo "== ctest in $dir" >&2
  ctest --test-dir "$dir" --output-on-failure --no-tests=error -j"$(nproc)" "$@"
}

# The C++ files of the tree: tracked, or new and not ignored (generated code
# lives in build directories, which git ignores).
cxx_files() { git ls-files -z --cached --others --exclude-standard '*.cc' '*.h'; }
py_files() { git ls-files -z --cached --others --exclude-standard '*.py'; }

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  setup) setup ;;
  build) setup; build build ;;
  format)
    cxx_files | xargs -0 clang-format -i
    py_files | xargs -0 black -q
    ;;
  check-format)
    cxx_files | xargs -0 clang-format --dry-run -Werror
    py_files | xargs -0 black -q --check --diff
    py_files | xargs -0 pyflakes3
    ;;
  bench)
    setup
    BUILD_TARGETS="tally-bench tally-reducer" build build >&2
    # The comparison with Gloo and Open MPI on the same sweep, unless the
    # flags choose their own --compare.
    compare=(--compare gloo,mpi)
    for a in "$@"; do [[ $a == --compare* ]] && compare=(); done
    exec build/bench/tally-bench "${compare[@]}" "$@"
    ;;
  test)
    setup
    build build
    # The real helm for the chart checks (tests/helm); without it they skip.
    deploy/fetch-helm.sh build/tools || echo "dev.sh: no helm; the chart checks will be skipped" >&2
    run_tests build
    # The threaded core under the sanitizers; every test runs real processes
    # built the same way, so a report in a reducer or worker fails its test.
    export ASAN_OPTIONS=abort_on_error=1:detect_leaks=1
    export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
    export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1
    # No python label there: an unsanitized interpreter cannot load a
    # sanitized module (those builds do not build it); nor the docs and
    # install checks, which the plain build ran (an unsanitized consumer
    # cannot link sanitized libraries).
    # The core subset: without the `extended` label (the fabric size sweep,
    # tests/CMakeLists.txt), which the plain build above ran.
    build build-asan -DTALLY_SANITIZE=address
    run_tests build-asan -LE "python|helm|docs|install|extended"
    build build-tsan -DTALLY_SANITIZE=thread
    # Not the fabric tests under TSan: libfabric is not instrumented, and a
    # TSan-built rank opens its endpoint 5x slower (1-2.5 s, over 3 s beside
    # another test), so their 4 s op timeouts failed on a loaded 2-core VM
    # (8 in one CI run, 2 in a quiet rerun). Plain and ASan+UBSan run them.
    # Nor the `sweep` families (one code path over many sizes and types):
    # TSan looks for interleavings, which the other tests drive harder.
    run_tests build-tsan -LE "python|helm|docs|install|extended|fabric|sweep"
    # The libFuzzer targets (docs/fuzzing.md): a clang build of them alone,
    # each fuzzing for TALLY_FUZZ_SECONDS (CI's time budget; the longer run
    # is documented there) and replaying its committed seeds.
    CC=clang CXX=clang++ BUILD_TARGETS=tally_fuzz build build-fuzz -DTALLY_FUZZ=ON
    cmake -S . -B build-fuzz -DTALLY_FUZZ_SECONDS="${TALLY_FUZZ_SECONDS:-20}" >/dev/null
    run_tests build-fuzz -L fuzz
    ;;
  *)
    sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
