"""The glue the model_repository/*/model.py adapters share: tensors <-> core types
(io), metrics that are safe from any thread, and the chat model's event loop."""
