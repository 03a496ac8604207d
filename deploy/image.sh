#!/usr/bin/env bash
# deploy/image.sh [IMAGE]: build the reducer image (deploy/Dockerfile) with
# podman from Debian packages only, no registry: mmdebstrap makes the two
# bases (a minimal Debian 12 for the build stage; the same with only the
# reducer's runtime libraries, documentation and apt lists stripped, for the
# final one), podman imports them and builds. IMAGE defaults to
# localhost/tally:<the project's version>. Push it with
#   podman push IMAGE REGISTRY/tally:TAG
# Then `deploy/image.sh check IMAGE` runs the reducer from the image's own
# filesystem as its user (podman run needs cgroups, which a build machine
# may lack), waits for /readyz and runs a checked tally-bench sweep against
# it from the image too. Work files go to build/image (TALLY_IMAGE_WORK).
set -euo pipefail
cd "$(dirname "$0")/.."

version=$(sed -n 's/^project(tally VERSION \([0-9.]*\).*/\1/p' CMakeLists.txt)
work=${TALLY_IMAGE_WORK:-build/image}
runtime_packages="libprotobuf32 libspdlog1.10 libfmt9 libssl3 libprometheus-cpp-core1.0 libfabric1"
mkdir -p "$work"
work=$(cd "$work" && pwd)

# This machine may refuse setrlimit, so no default ulimits; builds run in a
# chroot (no user namespaces or cgroups needed).
printf '[containers]\ndefault_ulimits = []\n' >"$work/containers.conf"
export CONTAINERS_CONF=$work/containers.conf

need() {
  local missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

build_image() {
  local image=$1 sha
  need mmdebstrap podman uidmap
  sha=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  # Only what an image needs of Debian's files: no manuals, docs (but their
  # copyrights) or translations.
  local slim=(
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*'
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright'
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/lintian/*'
  )
  echo "image.sh: the bases (mmdebstrap bookworm)" >&2
  mmdebstrap --quiet --variant=minbase "${slim[@]}" bookworm "$work/build-base.tar"
  # The runtime base keeps no apt lists or caches: nothing is installed at run time.
  mmdebstrap --quiet --variant=minbase "${slim[@]}" --include="${runtime_packages// /,}" \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/* "$1"/var/log/*' \
    bookworm "$work/runtime-base.tar"
  podman import --quiet "$work/build-base.tar" localhost/tally-base:build >/dev/null
  podman import --quiet "$work/runtime-base.tar" localhost/tally-base:runtime >/dev/null
  rm -f "$work/build-base.tar" "$work/runtime-base.tar"
  echo "image.sh: podman build $image" >&2
  podman build --isolation chroot -f deploy/Dockerfile -t "$image" \
    --build-arg BUILD_BASE=localhost/tally-base:build \
    --build-arg RUNTIME_BASE=localhost/tally-base:runtime \
    --build-arg TALLY_RUNTIME_PACKAGES="$runtime_packages" \
    --build-arg TALLY_VERSION="$version" --build-arg TALLY_GIT_SHA="$sha" .
  podman image inspect "$image" --format \
    'image.sh: {{.RepoTags}} {{.Size}} bytes, user {{.Config.User}}, cmd {{.Config.Cmd}}, ports {{.Config.ExposedPorts}}, labels {{.Config.Labels}}' >&2
}

# check IMAGE: the reducer from the image's filesystem, as user 10001, in
# its own mount and pid namespaces on this host's network; a tally-bench
# sweep from the image against it, every element checked.
check_image() {
  local image=$1 root port http
  root=$(podman image mount "$image")
  port=$((20000 + RANDOM % 20000))
  http=$((port + 1))
  local reducer_pid
  # The namespace's first process stays root so that it keeps unshare's
  # --kill-child signal (a change of user clears it): when unshare is
  # killed, it dies, and with it everything in its pid namespace.
  # shellcheck disable=SC2016
  unshare --mount --pid --fork --kill-child sh -c \
    'chroot --userspec=10001:10001 "$0" "$@" & wait' "$root" \
    tally-reducer --listen "127.0.0.1:$port" --http-listen "127.0.0.1:$http" &
  reducer_pid=$!
  # unshare ignores SIGTERM while it waits for its child: SIGKILL it.
  trap 'kill -KILL $reducer_pid 2>/dev/null || true; wait $reducer_pid 2>/dev/null || true; podman image unmount "$image" >/dev/null' RETURN
  local deadline=$((SECONDS + 30))
  until [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$http/readyz")" = 200 ]; do
    ((SECONDS < deadline)) || { echo "image.sh: the reducer did not get ready" >&2; return 1; }
    kill -0 $reducer_pid || { echo "image.sh: the reducer exited" >&2; return 1; }
    sleep 0.2
  done
  echo "image.sh: the reducer from $image is ready on 127.0.0.1:$port" >&2
  # The image is read-only, as the chart runs it: /tmp is a tmpfs of this
  # mount namespace (the chart's test pod mounts an emptyDir there), and
  # /proc this pid namespace's (tally-bench starts its workers from
  # /proc/self/exe's folder).
  # shellcheck disable=SC2016
  unshare --mount --pid --fork --kill-child sh -c \
    'mount -t tmpfs tmpfs "$0/tmp" && mount -t proc proc "$0/proc" && chroot --userspec=10001:10001 "$0" "$@"' "$root" \
    env TMPDIR=/tmp tally-bench --pool "127.0.0.1:$port" -W 4 -b 4K -e 16M -f 4 -w 2 -n 5
}

case "${1:-}" in
  check) check_image "${2:-localhost/tally:$version}" ;;
  *) build_image "${1:-localhost/tally:$version}" ;;
esac
