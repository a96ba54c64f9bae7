"""pdchat's own Llama forward pass computes transformers' numbers bit for bit (fp32, CPU, on
torch's GEMMs) for passes of two tokens or more, prompts in one pass or in chunks and ragged
decode rows alike, from the same weights; a one-token pass to rounding, the same greedy
token. On oneDNN's blocked weights (the default) it agrees to rounding, same tokens. Each
for every family it computes: tiny's Llama, and seeded tiny Qwen2 (q, k and v biases) and
Qwen3 (per-head q and k norms), their biases and norm weights drawn, not left at 0 and 1."""

import pytest
import torch

from pdchat import embedded, registry
from pdchat.core.generation import cpu_kernels, llama
from pdchat.core.generation.engine import CausalLM, DecodeBatch
from pdchat.core.settings import KVPoolOptions

MIB = 1 << 20


@pytest.fixture(scope="module", params=sorted(llama.FAMILIES))
def family_model_dir(request, tiny_model_dir, tmp_path_factory):
    """A seeded tiny model of each family the own forward computes."""
    if request.param == "llama":
        return tiny_model_dir
    import transformers

    names = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}
    config_name, model_name = names[request.param]
    config = getattr(transformers, config_name)(**{**embedded.TINY_SHAPE, "vocab_size": 4096})
    torch.manual_seed(7)
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):  # init leaves them 1 and 0: a swap would not show
                parameter.copy_(torch.rand_like(parameter) + 0.5 if "norm" in name else torch.randn_like(parameter))
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)
    return directory


def _engines(model_dir, blocked_gemms: bool = False):
    """The transformers forward and ours, both on torch ops (the C kernels below, and alone);
    ours on torch's GEMMs unless `blocked_gemms`."""
    pool = KVPoolOptions(8 * MIB, 16, False)
    theirs = CausalLM(model_dir, "cpu", pool=pool, forward="transformers")
    ours = CausalLM(model_dir, "cpu", pool=pool)
    ours.decode_kernels = None
    assert theirs.llama is None and ours.llama is not None
    if not blocked_gemms:
        ours.llama = llama.LlamaForward(ours.model, blocked_gemms=False)
    return theirs, ours


def _prefills_and_steps(engines: dict, prompts: list[list[int]]) -> dict[str, list[torch.Tensor]]:
    """Each engine's logits: the prompts prefilled (the last in chunks of 10, as decode's
    local prefill goes), then five greedy steps of them all as one ragged batch."""
    last = {}
    for name, engine in engines.items():
        batch, tokens = DecodeBatch(engine), []
        for prompt in prompts[:-1]:
            logits, sequence = engine.prefill(prompt)
            batch.join(sequence)
            tokens.append(logits)
        chunked = engine.sequence()  # the last prompt in chunks of 10, as decode's local prefill goes
        for start in range(0, len(prompts[-1]), 10):
            logits = engine.prefill_chunk(chunked, prompts[-1][start : start + 10])
        batch.join(chunked)
        tokens.append(logits)
        steps = [torch.stack(tokens)]
        for _ in range(5):
            steps.append(batch.step([int(row.argmax()) for row in steps[-1]]))
        batch.leave(list(range(len(prompts))))
        last[name] = steps
    return last


def _prompts(vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in (2, 9, 70, 33)]


def test_prefill_chunks_and_ragged_decode_steps_equal_transformers_bit_for_bit(family_model_dir):
    theirs, ours = _engines(family_model_dir)
    last = _prefills_and_steps({"theirs": theirs, "ours": ours}, _prompts(ours.vocab_size, 3))
    for step, (a, b) in enumerate(zip(last["theirs"], last["ours"], strict=True)):
        assert torch.equal(a, b), f"step {step}: logits differ by {(a - b).abs().max().item():.3g}"


def test_on_blocked_weights_prefills_and_steps_agree_to_rounding_and_pick_the_same_tokens(family_model_dir):
    """oneDNN's GEMMs over the blocked weights, for prompts and batched steps, beside torch's."""
    plain, blocked = _engines(family_model_dir)[1], _engines(family_model_dir, blocked_gemms=True)[1]
    gemms = [gemm for layer in blocked.llama.layers for gemm in (layer.qkv, layer.out, layer.gate_up, layer.down)]
    assert all(gemm.blocked and gemm._layout is not None for gemm in gemms)  # oneDNN's layout, made at load
    assert not any(gemm.blocked for layer in plain.llama.layers for gemm in (layer.qkv, layer.gate_up))
    last = _prefills_and_steps({"plain": plain, "blocked": blocked}, _prompts(plain.vocab_size, 4))
    for a, b in zip(last["plain"], last["blocked"], strict=True):
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_a_one_token_pass_agrees_to_rounding(family_model_dir):
    theirs, ours = _engines(family_model_dir)
    for token in (1, 77, 4000):
        (a, _), (b, _) = theirs.prefill([token]), ours.prefill([token])
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)
        assert int(a.argmax()) == int(b.argmax())


def test_decode_steps_with_the_c_kernels_agree_to_rounding_and_pick_the_same_tokens(family_model_dir, tmp_path):
    """Ragged rows stepped with the C kernels between the GEMMs, beside the same rows on torch ops."""
    kernels = cpu_kernels.load(tmp_path)
    if kernels is None:
        pytest.skip("no C compiler on this host: the kernels are optional")
    _, ours = _engines(family_model_dir, blocked_gemms=True)  # the GEMMs a served step runs beside the kernels
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, ours.vocab_size, (n,), generator=generator).tolist() for n in (3, 40, 17, 129)]
    steps = {}
    for name, chosen in (("torch", None), ("c", kernels)):
        ours.decode_kernels = None  # the prompts' passes are the torch path's in both
        batch, first = DecodeBatch(ours), []
        for prompt in prompts:
            logits, sequence = ours.prefill(prompt)
            batch.join(sequence)
            first.append(int(logits.argmax()))
        ours.decode_kernels, tokens, logits_seen = chosen, [first], []
        for _ in range(6):
            logits = batch.step(tokens[-1])
            logits_seen.append(logits)
            tokens.append(batch.argmax(logits))
        batch.leave(list(range(len(prompts))))
        steps[name] = tokens, logits_seen
    assert steps["c"][0] == steps["torch"][0]
    for a, b in zip(steps["torch"][1], steps["c"][1], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_prompts_with_the_c_kernels_agree_to_rounding_and_pick_the_same_tokens(family_model_dir, tmp_path):
    """Prompts' passes (whole, over this pass's own keys, and in chunks, over the pool's) take
    their norms, SwiGLU, rotary and KV store from the kernels, then batched steps all of
    theirs, beside the same passes on torch ops."""
    kernels = cpu_kernels.load(tmp_path)
    if kernels is None:
        pytest.skip("no C compiler on this host: the kernels are optional")
    on_torch, on_kernels = (_engines(family_model_dir, blocked_gemms=True)[1] for _ in range(2))
    on_kernels.decode_kernels = kernels
    last = _prefills_and_steps({"torch": on_torch, "c": on_kernels}, _prompts(on_torch.vocab_size, 6))
    for a, b in zip(last["torch"], last["c"], strict=True):
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_the_stacked_weights_are_the_models_own():
    """The q/k/v and gate/up projections are views of the stacks: no second copy, and
    transformers' forward of the same model reads the same numbers."""
    engine = CausalLM(embedded.ensure_model(registry.TINY), "cpu")
    layer, ours = engine.model.model.layers[0], engine.llama.layers[0]
    for projection in (layer.self_attn.q_proj, layer.self_attn.v_proj, layer.mlp.up_proj):
        assert projection.weight.untyped_storage().data_ptr() in (
            ours.qkv.weight.untyped_storage().data_ptr(),
            ours.gate_up.weight.untyped_storage().data_ptr(),
        )


def test_only_what_it_computes_exactly_takes_it():
    gpt_oss = CausalLM(embedded.ensure_model(registry.TINY_GPTOSS), "cpu")
    assert gpt_oss.llama is None and not llama.supports(gpt_oss.model)
    bf16 = CausalLM(embedded.ensure_model(registry.TINY), "cpu", "bfloat16")
    assert bf16.llama is None and bf16.decode_kernels is None
