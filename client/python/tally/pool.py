"""A local pool of tally-reducer processes on 127.0.0.1, for examples, tests
and trying tally on one machine (a real pool runs from the Helm chart).

    with tally.pool.LocalPool(shards=2) as pool:
        client = tally.Client(pool=pool.address, job="j", rank=0, world_size=1)

Each reducer listens on a free port (``--listen 127.0.0.1:0``) and reports
it through ``--ready-file``; start() waits for every one with a deadline.
"""

import os
import shutil
import signal
import subprocess
import tempfile
import time


def find_reducer(path=None):
    """The tally-reducer binary: ``path``, $TALLY_REDUCER, the one this
    package carries (a wheel), or one on PATH."""
    from ._cli import reducer_path

    for candidate in (
        path,
        os.environ.get("TALLY_REDUCER"),
        reducer_path(),
        shutil.which("tally-reducer"),
    ):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError(
        "tally-reducer not found: pass its path, set TALLY_REDUCER, or put it on PATH "
        "(a build has it at build/reducer/tally-reducer)"
    )


class LocalPool:
    """S reducers (one replica group) on loopback, stopped on close().

    ``args`` go to every reducer (e.g. ["--max-chunk-bytes", "4096"]); their
    stderr goes to ``log_dir``/reducer-<shard>.log (a temporary directory by
    default, kept in ``self.dir``).
    """

    def __init__(self, shards=1, reducer=None, args=(), log_dir=None, start_timeout=15.0):
        self.shards = shards
        self.processes = []
        self.reducer = find_reducer(reducer)
        self.dir = log_dir or tempfile.mkdtemp(prefix="tally-pool-")
        self._own_dir = log_dir is None
        self.args = list(args)
        self.start_timeout = start_timeout
        self.addresses = []
        try:
            for s in range(shards):
                self.processes.append(self._spawn(s, "127.0.0.1:0"))
            deadline = time.monotonic() + start_timeout
            for s, proc in enumerate(self.processes):
                self.addresses.append(self._await_ready(s, proc, deadline))
        except BaseException:
            self.close()
            raise

    def _spawn(self, shard, listen):
        ready = os.path.join(self.dir, "ready-%d" % shard)
        if os.path.exists(ready):
            os.unlink(ready)
        # Appended to: a restarted reducer's log follows its predecessor's.
        with open(os.path.join(self.dir, "reducer-%d.log" % shard), "ab") as log:
            cmd = [
                self.reducer,
                "--listen",
                listen,
                "--shard",
                str(shard),
                "--shards",
                str(self.shards),
                "--ready-file",
                ready,
            ] + self.args
            return subprocess.Popen(cmd, stdout=log, stderr=log)

    def _await_ready(self, shard, proc, deadline):
        ready = os.path.join(self.dir, "ready-%d" % shard)
        while True:
            if os.path.exists(ready):
                with open(ready) as f:
                    return f.read().strip()
            if proc.poll() is not None:
                raise RuntimeError(
                    "tally-reducer shard %d exited with %s before listening: %s"
                    % (shard, proc.returncode, self.log(shard)[-2000:])
                )
            if time.monotonic() > deadline:
                raise RuntimeError("tally-reducer shard %d did not listen in time" % shard)
            time.sleep(0.01)

    @property
    def address(self):
        """The pool as TALLY_POOL wants it: "host:port,..." in shard order."""
        return ",".join(self.addresses)

    def log(self, shard):
        try:
            with open(os.path.join(self.dir, "reducer-%d.log" % shard), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def kill(self, shard, sig=signal.SIGKILL):
        """Sends ``sig`` to reducer ``shard`` (SIGKILL: a crash, no goodbye)."""
        self.processes[shard].send_signal(sig)

    def restart(self, shard):
        """Kills reducer ``shard`` (SIGKILL) if it runs and starts a new one
        at its address, as a restarted pod comes back; returns once it
        listens."""
        old = self.processes[shard]
        if old.poll() is None:
            old.kill()
        old.wait()
        self.processes[shard] = self._spawn(shard, self.addresses[shard])
        self._await_ready(shard, self.processes[shard], time.monotonic() + self.start_timeout)

    def close(self, grace=5.0):
        """SIGTERM, then SIGKILL after ``grace`` seconds; returns the exit codes."""
        for p in self.processes:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = []
        deadline = time.monotonic() + grace
        for p in self.processes:
            try:
                codes.append(p.wait(max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        self.processes = []
        return codes

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if self.processes:
            self.close(grace=1.0)
