"""`python -m tf_metal_ops bench`: the benchmark (see `suite` for what it measures).

`suite` holds the command's arguments, the CustomLoss sections and the report; `linear_head`
the section of `linear_cross_entropy`; `process` the child processes both measure memory in.
"""
