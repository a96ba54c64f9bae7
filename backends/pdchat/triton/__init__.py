"""Glue shared by the model_repository/*/model.py adapters (imports the python backend's utils)."""
