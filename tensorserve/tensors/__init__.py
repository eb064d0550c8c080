"""The bottom layer: what a tensor is, shared by every other package.

``dtypes`` is the dtype table (numpy, torch and KServe v2 names);
``wire_tensor`` is a typed tensor as it arrives off the wire; ``results`` is
what a forward returns per-row output parameters in and what one caller gets
back with its share of them. Nothing here
imports any other tensorserve package.
"""
