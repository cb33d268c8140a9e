"""The names of the tensor dtypes the wire carries, without torch, so a command line can offer them.

The codec (frame.py) maps each name to its torch dtype; shards are written in the same three dtypes.
The order is the one a server announces in its limits.
"""

DTYPE_NAMES: tuple[str, ...] = ("float16", "bfloat16", "float32")
