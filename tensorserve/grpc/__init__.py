"""The KServe v2 / Triton gRPC front end (``tensorserve serve --grpc-port``),
beside HTTP on the same event loop and data plane.

    server.py     GrpcFrontEnd: the grpc.aio server, its port and message limit
    service.py    the RPCs: thin handlers over the data plane
    codec.py      ModelInferRequest / ModelInferResponse <-> InferRequest
    messages.py   the data plane's answers as the service's messages
    errors.py     tensorserve errors -> gRPC statuses, from errors.CODES
    generated/    stubs from Triton's grpc_service.proto and model_config.proto
                  (scripts/regenerate_grpc_stubs.py; the definition: protos/)
"""
