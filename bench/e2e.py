"""End-to-end benchmark: `jaxspec bench` (jaxspec/bench/sweep.py) run as a script.

PYTHONPATH=$PWD python3 bench/e2e.py --out $OUT [jaxspec bench flags]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxspec.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench"] + sys.argv[1:]))
