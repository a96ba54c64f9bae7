"""Clients of the pdchat model repository, built on tritonclient (gRPC and HTTP)."""
