"""The wheel's console script `tally-reducer`: runs the reducer binary the
package carries (tally/_bin, beside the libraries it needs in tally/_lib)."""

import os
import sys


def reducer_path():
    """Where the package carries tally-reducer (it may not: a source-tree layout does not)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bin", "tally-reducer")


def reducer_main():
    path = reducer_path()
    if not os.access(path, os.X_OK):
        sys.stderr.write(
            "tally-reducer: this install of the tally package carries no reducer "
            "(%s); build it from the source tree (deploy/dev.sh build)\n" % path
        )
        sys.exit(2)
    os.execv(path, [path] + sys.argv[1:])
