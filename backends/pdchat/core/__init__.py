"""Plain typed Python behind the Triton models; nothing here imports Triton.

request/     what clients send: parsing and validation, chat templates, output grammars
generation/  the model: forward passes, sampling, one request's generation, the batch scheduler
output/      what clients get: incremental detokenization, stop strings, reasoning and
             tool-call parsing, OpenAI-shaped responses
kv/          KV caches between servers: the typed handle, connectors (shm, nixl)
settings     config parameters and environment variables, with their defaults
errors       ErrorCode (Triton, gRPC, HTTP, OpenAI spellings), PdchatError and its kinds, the wire tag
"""
