"""The model side: forward passes (single and batched), sampling, constrained decoding,
one request's generation and the decode scheduler that batches many."""
