"""pdchat: prefill/decode disaggregated chat serving on Triton, tokenizing once.

Layout of this package:
  core/      plain typed Python: requests, generation, outputs, KV transfer, settings.
             No Triton imports, so it is unit-testable without a server.
  triton/    the thin glue the model_repository/*/model.py adapters share.
  tensors    every tensor name of the model repository (and chat's contract).
  registry   roles, KV connectors and embedded models, one list each.
  models     which model a server runs; embedded builds the embedded ones.
  launcher   tritonserver processes (one role, or a P/D pair with the router); cli.
  clients/   (source in clients/) chat client, P/D router, HTTP front.
  ensemble/  (source in ensemble/) the chat model's route decision, gate and handoff.
"""

__version__ = "0.1.0"
