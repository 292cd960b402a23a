"""pe-serve's gRPC API for Python: `pip install "pe-client[grpc]"`.

`GrpcPEClient` and `AsyncGrpcPEClient` have the HTTP clients' methods (`generate`,
`generate_stream`, `score`, `models`, `health`), arguments and result types, plus
`cancel(request_id)`, and raise the same exceptions::

    from pe_client.grpc import GrpcPEClient

    with GrpcPEClient("127.0.0.1:50051") as client:
        print(client.generate(prompt="def fib(n):", pe="rope", max_new_tokens=32).text)
"""

from pe_client.grpc.async_client import AsyncGrpcPEClient, AsyncGrpcStream
from pe_client.grpc.client import GrpcPEClient, GrpcStream

__all__ = ["AsyncGrpcPEClient", "AsyncGrpcStream", "GrpcPEClient", "GrpcStream"]
