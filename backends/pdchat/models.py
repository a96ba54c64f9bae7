"""Which model a server runs: an embedded model's name or a Hugging Face directory."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from pdchat import embedded, registry
from pdchat.core import settings
from pdchat.core.errors import ModelUnavailable
from pdchat.core.generation.model_support import check_supported


@dataclass(frozen=True)
class ModelSettings:
    """The resolved model: a Hugging Face causal-LM directory and where to run it."""

    path: Path
    device: str
    dtype: str = "auto"
    threads: int | None = None  # torch's CPU threads (None: torch's default)
    names: tuple[str, ...] = ()  # setting SERVED_MODEL_NAME; empty: the directory's name
    forward: str = "auto"  # setting FORWARD

    @property
    def served_names(self) -> tuple[str, ...]:
        """Names clients may use in the request's `model` field (the first is reported):
        the setting's, else the directory's name."""
        return self.names or (self.path.name,)

    @property
    def served_name(self) -> str:
        """The name responses report as their `model`."""
        return self.served_names[0]

    def on_instance(self, kind: str, device_id: int) -> ModelSettings:
        """Where a Triton model instance runs its model.

        The configs leave the instance kind to Triton (KIND_AUTO): KIND_GPU, one instance
        group per GPU, on a host whose tritonserver sees GPUs; KIND_CPU elsewhere. A
        KIND_GPU instance runs on the GPU Triton gave it (`device` may say `auto` or
        `cuda`, not another place); a KIND_CPU or KIND_MODEL instance goes where `device`
        says (`auto`: CUDA when torch sees it)."""
        if kind != "GPU":
            return self
        if self.device not in ("auto", "cuda"):
            raise ModelUnavailable(
                f"Triton runs this instance on GPU {device_id} (instance_group kind KIND_GPU) "
                f"but {settings.DEVICE.names} says {self.device!r}; use auto or cuda, "
                "or give the instance group kind KIND_CPU"
            )
        return replace(self, device=f"cuda:{device_id}")


def resolve_model(parameters: dict[str, str], environ: os._Environ | dict | None = None) -> ModelSettings:
    """Resolve the model spec (embedded name or directory) into a usable directory.

    Settings MODEL, DEVICE, DTYPE, TORCH_THREADS, SERVED_MODEL_NAME and FORWARD; embedded names are built into
    the cache on first use. ModelUnavailable for a model pdchat's engine does not support
    (core.generation.model_support), unless setting ALLOW_UNSUPPORTED_MODEL says to serve it
    or setting ENGINE names vLLM's.
    """
    spec = settings.MODEL.get(parameters, environ)
    device = settings.DEVICE.get(parameters, environ)
    dtype = settings.DTYPE.get(parameters, environ)
    threads = settings.torch_threads(parameters, environ)
    names = settings.SERVED_MODEL_NAME.get(parameters, environ)
    forward = settings.FORWARD.get(parameters, environ)
    if spec in registry.EMBEDDED_MODELS:
        path = embedded.ensure_model(spec)
    else:
        path = Path(spec).expanduser()
        if not (path / "config.json").is_file():
            known = ", ".join(sorted(registry.EMBEDDED_MODELS))
            raise ModelUnavailable(
                f"model path '{spec}' is not a Hugging Face model directory (no config.json there); "
                f"give a directory or one of the embedded models: {known}"
            )
    if settings.ENGINE.get(parameters, environ) == "pdchat":  # vLLM's engine has its own model coverage
        check_supported(path, settings.ALLOW_UNSUPPORTED_MODEL.get(parameters, environ))
    return ModelSettings(path, device, dtype, threads, names, forward)
