"""``python -m cluster.engine.kernels.prebuild``: compiles the native CPU kernels now, so that a
first ``tandem up`` does not (its two workers spent ~7 s of CPU each compiling them on 2 cores;
``scripts/bootstrap.sh`` runs this when it installs)."""

from __future__ import annotations

import sys

from cluster.engine.kernels.build import LIBRARIES, load_library


def main() -> int:
    for library in LIBRARIES:
        built = load_library(library) is not None
        print(f"[tandem] native kernel {library}: " + ("ready" if built else "not built (the warning above says why); "
                                                        "the plain-torch path serves"), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
