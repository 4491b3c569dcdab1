"""`python -m tf_metal_ops.tools.bench`: the benchmark, and the entry of its child processes."""

import sys

from tf_metal_ops.tools.bench.suite import main

if __name__ == "__main__":
    sys.exit(main())
