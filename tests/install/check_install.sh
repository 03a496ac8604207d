#!/usr/bin/env bash
# CTest Install.ConsumersBuildAndRunAgainstTheInstalledTree: installs the
# build tree ($1) into a scratch prefix with `cmake --install`, builds the
# consumer project (tests/install/consumer) against it with
# find_package(tally), and a C program with pkg-config, then runs each as
# two ranks against the installed tally-reducer. Exits non-zero, saying
# which step failed, if any does.
set -euo pipefail
build=$1
here=$(cd "$(dirname "$0")" && pwd)
scratch=$(mktemp -d)
reducer_pid=
cleanup() {
  [ -n "$reducer_pid" ] && kill "$reducer_pid" 2>/dev/null && wait "$reducer_pid" 2>/dev/null
  rm -rf "$scratch"
}
trap cleanup EXIT
prefix=$scratch/prefix
step() { echo "== $*"; }

step "cmake --install $build --prefix $prefix"
cmake --install "$build" --prefix "$prefix" >"$scratch/install.log"
for f in bin/tally-reducer bin/tally-bench lib/libtally.a lib/libtally.so lib/libtally_c.so \
  include/tally/tally.h include/tally/client/client.h lib/cmake/tally/tallyConfig.cmake \
  lib/pkgconfig/tally.pc; do
  [ -e "$prefix/$f" ] || { echo "not installed: $f"; exit 1; }
done

step "find_package(tally): configure and build the consumer project"
cmake -S "$here/consumer" -B "$scratch/consumer" -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_BUILD_TYPE=Release >"$scratch/configure.log" || { cat "$scratch/configure.log"; exit 1; }
cmake --build "$scratch/consumer" -- -j2 >"$scratch/build.log" 2>&1 || { cat "$scratch/build.log"; exit 1; }

step "pkg-config tally: build the C program"
export PKG_CONFIG_PATH=$prefix/lib/pkgconfig
# shellcheck disable=SC2046
cc -std=c11 -Wall -Werror -o "$scratch/consumer_c_pc" "$here/consumer/consumer.c" \
  $(pkg-config --cflags --libs tally)

step "the installed tally-reducer"
"$prefix/bin/tally-reducer" --version
"$prefix/bin/tally-reducer" --listen 127.0.0.1:0 --ready-file "$scratch/ready" \
  --log-level warn 2>"$scratch/reducer.err" &
reducer_pid=$!
for _ in $(seq 100); do [ -s "$scratch/ready" ] && break; sleep 0.1; done
[ -s "$scratch/ready" ] || { echo "the reducer did not start"; cat "$scratch/reducer.err"; exit 1; }
pool=$(cat "$scratch/ready")

run_pair() {  # NAME PROGRAM [LD_LIBRARY_PATH]
  local name=$1 program=$2 libs=${3:-} pids=() r status=0
  for r in 0 1; do
    env TALLY_POOL="$pool" TALLY_JOB="$name" TALLY_RANK=$r TALLY_WORLD_SIZE=2 \
      TALLY_OP_TIMEOUT_MS=20000 ${libs:+LD_LIBRARY_PATH=$libs} timeout 60 "$program" \
      >"$scratch/$name.$r.out" 2>&1 &
    pids+=($!)
  done
  for r in 0 1; do wait "${pids[$r]}" || status=1; done
  for r in 0 1; do
    if [ $status -ne 0 ] || [ "$(cat "$scratch/$name.$r.out")" != ok ]; then
      echo "$name rank $r:"; cat "$scratch/$name.$r.out"; status=1
    fi
  done
  [ $status -eq 0 ] && echo "$name: both ranks ok"
  return $status
}
step "run the consumers as two ranks"
run_pair cpp "$scratch/consumer/consumer_cpp"
# libtally.so, found through the installed tree's lib (the consumer's RPATH
# names it too; LD_LIBRARY_PATH as a user without one would set it).
# ldd's output is read whole first: `ldd | grep -q` under pipefail fails when
# grep exits at its match and ldd, still writing, dies of SIGPIPE.
libs=$(ldd "$scratch/consumer/consumer_cpp_shared")
grep -q "$prefix/lib/libtally.so" <<<"$libs" ||
  { echo "consumer_cpp_shared does not load the installed libtally.so:"; echo "$libs"; exit 1; }
run_pair cpp-shared "$scratch/consumer/consumer_cpp_shared" "$prefix/lib"
run_pair c "$scratch/consumer/consumer_c"
run_pair c-pkg-config "$scratch/consumer_c_pc" "$prefix/lib"
