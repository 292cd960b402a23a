"""The gRPC API (`proto/pe_serve/v1/pe_serve.proto`): the HTTP API's operations over the same engine."""
