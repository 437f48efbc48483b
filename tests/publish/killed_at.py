"""Run gkbuild, SIGKILLing itself just before its K-th rename of a ``.partial`` into place: a kill
inside each write's window, deterministically (``python -m tests.publish.killed_at K ARGS...``;
K=0 counts the renames and prints the count on stderr at exit)."""

import atexit
import os
import signal
import sys

from gkbuild import cli


def main() -> None:
    k, seen, real = int(sys.argv[1]), [0], os.replace

    def replace(src, dst, *a, **kw):
        if str(src).endswith(".partial"):
            seen[0] += 1
            if seen[0] == k:
                os.kill(os.getpid(), signal.SIGKILL)
        return real(src, dst, *a, **kw)

    os.replace = replace
    if k == 0:
        atexit.register(lambda: print(f"renames {seen[0]}", file=sys.stderr))
    cli.main(sys.argv[2:])


if __name__ == "__main__":
    main()
