"""`python -m tf_metal_ops COMMAND`: see tf_metal_ops/cli.py for the commands and exit codes."""

from tf_metal_ops.cli import console_main

if __name__ == "__main__":
    console_main()
