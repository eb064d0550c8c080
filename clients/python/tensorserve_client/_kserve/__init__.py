"""Triton's KServe v2 ``grpc_service.proto`` and ``model_config.proto``
messages, for the gRPC transport (``_grpc.py``).

Copies of the server's ``tensorserve/grpc/generated/*_pb2.py`` and their
``.pyi`` type stubs with the package in their imports renamed
(``scripts/regenerate_grpc_stubs.py`` writes both; the server's
tests/client/test_grpc.py holds them equal). The
client never imports the server, and copying two message modules is lighter
than depending on tritonclient[grpc]. The service stub is not copied: the
transport calls the five methods it needs by name.
"""
