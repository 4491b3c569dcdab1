"""`python -m tf_metal_ops COMMAND`: the commands and exit codes are in tf_metal_ops/tools/cli.py."""

from tf_metal_ops.tools.cli import console_main

if __name__ == "__main__":
    console_main()
