"""The command-line tools around the library: `python -m tf_metal_ops` / `tf-metal-ops`.

`cli` parses the commands; `environment` (info), `checks` (check), `demo` and `bench` do them.
Nothing of the library imports these modules.
"""
