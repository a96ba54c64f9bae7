"""pdchat: prefill/decode disaggregated chat serving on Triton, tokenizing once.

Layout of this package:
  core/    plain typed Python: request parsing, rendering, the engine, decoding.
           No Triton imports, so it is unit-testable without a server.
  triton/  the thin glue the model_repository/*/model.py adapters share.
  clients/ (source in clients/) tritonclient-based chat client.
  ensemble/ (source in ensemble/) the pipeline chaining the stages in-process.
"""

__version__ = "0.1.0"
