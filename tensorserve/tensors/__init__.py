"""The bottom layer: what a tensor is, shared by every other package.

``dtypes`` is the dtype table (numpy, torch and KServe v2 names);
``wire_tensor`` is a typed tensor as it arrives off the wire. Nothing here
imports any other tensorserve package.
"""
