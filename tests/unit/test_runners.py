"""CausalLM chooses the runner of its passes once, from its forward, kernels and GreedyHead,
and names it (`path`); swapping a part on a loaded engine chooses again, and every runner
gives the same greedy tokens."""

import pytest
import torch

from pdchat import embedded, registry
from pdchat.core.engine_api import OWN_LLAMA, TRANSFORMERS
from pdchat.core.generation import llama, runners
from pdchat.core.generation.engine import CausalLM, DecodeBatch
from pdchat.core.settings import KVPoolOptions

MIB = 1 << 20


def _greedy_tokens(engine: CausalLM, prompts: list[list[int]], steps: int = 5) -> list[list[int]]:
    batch, tokens = DecodeBatch(engine), []
    for prompt in prompts:
        _, token = engine.prefill_chunk_choosing(sequence := engine.sequence(), prompt, greedy=True)
        batch.join(sequence)
        tokens.append(token)
    seen = [tokens]
    for _ in range(steps):
        _, chosen = batch.step_rows(seen[-1], [True] * len(prompts))
        seen.append(chosen)
    batch.leave(list(range(len(prompts))))
    return seen


def test_each_part_names_its_runner_and_every_runner_picks_the_same_tokens(tiny_model_dir, kernels):
    pool = KVPoolOptions(8 * MIB, 16, False)
    theirs = CausalLM(tiny_model_dir, "cpu", pool=pool, forward="transformers")
    ours = CausalLM(tiny_model_dir, "cpu", pool=pool)
    assert type(theirs._runner) is runners.TransformersRunner and theirs.path.label() == "transformers"
    assert theirs.path.describe().startswith("transformers forward")

    ours.decode_kernels = None
    assert type(ours._runner) is runners.OwnForwardRunner and ours.path.label() == "llama"
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, ours.vocab_size, (n,), generator=generator).tolist() for n in (3, 40, 17)]
    expected = _greedy_tokens(theirs, prompts)
    assert _greedy_tokens(ours, prompts) == expected

    ours.decode_kernels = kernels  # chosen again: the GreedyHead made now, not on a first pass
    assert type(ours._runner) is runners.GreedyHeadRunner and ours.path.label() == "llama+c-kernels+greedy-head"
    assert f"C kernels ({kernels.isa}" in ours.path.describe()
    assert _greedy_tokens(ours, prompts) == expected

    ours.use_greedy_head(False)
    assert type(ours._runner) is runners.OwnForwardRunner and ours.path.label() == "llama+c-kernels"
    assert _greedy_tokens(ours, prompts) == expected


def test_a_model_the_own_forward_does_not_compute_runs_transformers():
    gpt_oss = CausalLM(embedded.ensure_model(registry.TINY_GPTOSS), "cpu")
    assert gpt_oss.path.forward == TRANSFORMERS and not gpt_oss.path.greedy_head
    bf16 = CausalLM(embedded.ensure_model(registry.TINY), "cpu", "bfloat16")
    assert bf16.path.label() == "transformers" and bf16.path.dtype == "bfloat16"


def test_gpt_oss_batched_on_paged_attention_equals_transformers_generate():
    """docs/models.md's check for the gpt_oss family: three prompts stepped together, one past
    the 128-token sliding window, give transformers' own greedy tokens (eager attention)."""
    from transformers import AutoModelForCausalLM

    model_dir = embedded.ensure_model(registry.TINY_GPTOSS)
    ours = CausalLM(model_dir, "cpu", pool=KVPoolOptions(32 * MIB, 16, False))
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, ours.vocab_size, (n,), generator=generator).tolist() for n in (5, 150, 33)]
    steps = 8
    seen = _greedy_tokens(ours, prompts, steps=steps)
    for row, prompt in enumerate(prompts):
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=steps + 1, do_sample=False)
        assert [tokens[row] for tokens in seen] == expected[0, len(prompt) :].tolist()


def test_the_fast_path_runs_on_more_than_one_torch_thread_and_picks_the_same_tokens(tiny_model_dir, kernels):
    """Issue 56: the kernels and the greedy head ran only with exactly one torch thread, so on
    hosts of more than 3 cores (a stage takes half) they never ran. On two threads they run,
    split over both, and give the tokens transformers' forward gives."""
    pool = KVPoolOptions(8 * MIB, 16, False)
    before = torch.get_num_threads()
    try:
        ours = CausalLM(tiny_model_dir, "cpu", threads=2, pool=pool)
        if ours.decode_kernels is None:
            ours.decode_kernels = kernels  # a host whose setup built none: the test's own build
        assert ours.path.kernels is not None and ours.path.kernel_threads == 2
        theirs = CausalLM(tiny_model_dir, "cpu", threads=2, pool=pool, forward="transformers")
        generator = torch.Generator().manual_seed(11)
        prompts = [torch.randint(0, ours.vocab_size, (n,), generator=generator).tolist() for n in (4, 37, 90)]
        assert _greedy_tokens(ours, prompts) == _greedy_tokens(theirs, prompts)
    finally:
        torch.set_num_threads(before)


# Seeded tiny models of the families docs/models.md lists on transformers' forward with paged
# attention: a sliding window of 32 (where the family has one), prompts past it.
SMALL = {
    "vocab_size": 4096,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 32}),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"head_dim": 16, "sliding_window": 32, "layer_types": ["sliding_attention", "full_attention"]},
    ),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_supported_family_batched_on_paged_attention_equals_transformers_generate(tmp_path, family):
    """docs/models.md's check for each family on transformers' forward: three prompts stepped
    together, two past the sliding window, give transformers' own greedy tokens (eager)."""
    import transformers

    from pdchat.core.generation.model_support import SUPPORTED

    assert family in SUPPORTED

    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**SMALL, **extra)
    torch.manual_seed(0)
    getattr(transformers, model_name)(config).save_pretrained(tmp_path)
    ours = CausalLM(tmp_path, "cpu", pool=KVPoolOptions(32 * MIB, 16, False))
    assert ours.path.forward == (OWN_LLAMA if family in llama.FAMILIES else TRANSFORMERS)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 4096, (n,), generator=generator).tolist() for n in (5, 70, 41)]
    steps = 8
    seen = _greedy_tokens(ours, prompts, steps=steps)
    for row, prompt in enumerate(prompts):
        expected = reference.generate(
            torch.tensor([prompt]), max_new_tokens=steps + 1, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        assert [tokens[row] for tokens in seen] == expected[0, len(prompt) :].tolist()
