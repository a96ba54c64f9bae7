"""The paged engine: rows of different lengths joining and leaving mid-way decode exactly
the tokens each would alone (greedy, fp32, CPU), against transformers' own model and
cache; memory held is the blocks used; the prefix cache gives the same tokens it saves."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdchat.core.errors import Unavailable
from pdchat.core.generation import cpu_kernels
from pdchat.core.generation.engine import CausalLM, DecodeBatch, PromptPrefill
from pdchat.core.settings import KVPoolOptions

STEPS = 16
MIB = 1 << 20


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return CausalLM(tiny_model_dir, "cpu")


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def alone(reference, prompt, steps=STEPS):
    """Greedy tokens of transformers' model with its own DynamicCache: no pdchat code."""
    out = reference(input_ids=torch.tensor([prompt]), use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(steps - 1):
        out = reference(input_ids=torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def prompts_of(lengths, vocab_size, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize(
    ("block_tokens", "prefix_caching", "c_kernels"), [(16, True, False), (3, False, False), (16, True, True)]
)
def test_joining_and_leaving_rows_decode_what_each_would_alone(
    tiny_model_dir, reference, block_tokens, prefix_caching, c_kernels, tmp_path
):
    engine = CausalLM(tiny_model_dir, "cpu", pool=KVPoolOptions(8 * MIB, block_tokens, prefix_caching))
    # The C decode kernels, which a stage model with one torch thread runs, in place of torch's ops.
    engine.decode_kernels = cpu_kernels.load(tmp_path) if c_kernels else None
    if c_kernels and engine.decode_kernels is None:
        pytest.skip("no C compiler on this host")
    prompts = prompts_of((5, 40, 17, 300, 2, 90, 64, 11), engine.vocab_size)
    prompts.append(prompts[3][:150] + prompts[0])  # shares 150 tokens with another prompt
    expected = [alone(reference, p) for p in prompts]
    batch, rows, results, waiting, turn = DecodeBatch(engine), [], {}, list(range(len(prompts))), 0
    while waiting or rows:
        if waiting and turn % 3 == 0:  # a new request joins every third step
            index = waiting.pop(0)
            logits, sequence = engine.prefill(prompts[index])
            batch.join(sequence)
            rows.append((index, [int(logits.argmax())]))
        done = [row for row, (index, tokens) in enumerate(rows) if len(tokens) >= STEPS - index % 4]
        results.update(rows[row] for row in done)
        batch.leave(done)
        rows = [r for row, r in enumerate(rows) if row not in done]
        if rows:
            _, chosen = batch.step_rows([tokens[-1] for _, tokens in rows], [True] * len(rows))  # as the scheduler
            for (_, tokens), token in zip(rows, chosen, strict=True):
                tokens.append(token)
        turn += 1
    for index in range(len(prompts)):
        assert results[index] == expected[index][: len(results[index])], f"prompt {index} diverged in the batch"
    assert len(batch) == 0 and batch.kv_bytes() == 0
    if prefix_caching:
        assert engine.pool.usage().cached_blocks > 0, "full blocks stayed cached after their rows left"


def test_kv_held_is_the_blocks_used_not_the_longest_row(engine):
    per_token = engine.kv_bytes_per_token()
    batch = DecodeBatch(engine)
    batch.join(engine.prefill(list(range(1, 300)))[1])
    batch.join(engine.prefill([5, 6, 7])[1])
    assert batch.kv_bytes() == (19 + 1) * 16 * per_token  # 299 tokens in 19 blocks, 3 in one
    batch.leave([0])
    assert batch.kv_bytes() == 16 * per_token
    batch.leave([0])
    assert batch.kv_bytes() == 0


def test_a_cached_prefix_gives_the_same_tokens_and_is_not_computed_again(tiny_model_dir, reference):
    engine = CausalLM(tiny_model_dir, "cpu", pool=KVPoolOptions(8 * MIB, 16, True))
    system, turn = prompts_of((200, 30), engine.vocab_size, seed=1)
    first_logits, first = engine.prefill(system + turn)
    assert first.cached_tokens == 0
    first.release()
    logits, again = engine.prefill(system + turn)
    assert again.cached_tokens == 224, "every full block but the one holding the last token"
    assert int(logits.argmax()) == int(first_logits.argmax())
    again.release()
    _, other_tenant = engine.prefill(system + turn, cache_salt="tenant-b")
    assert other_tenant.cached_tokens == 0, "another cache_salt shares nothing"
    other_tenant.release()
    batch = DecodeBatch(engine)
    next_logits, next_turn = engine.prefill(system + turn + [9, 10, 11])
    assert next_turn.cached_tokens == 224, "the next turn hits the blocks of this one's prompt"
    batch.join(next_turn)
    tokens = [int(next_logits.argmax())]
    for _ in range(5):
        tokens.append(int(batch.step([tokens[-1]])[0].argmax()))
    assert tokens == alone(reference, system + turn + [9, 10, 11], 6)


def test_prompts_admitted_together_share_the_prefix_the_first_of_them_computes(tiny_model_dir):
    """Two prompts of one system prompt, both started before either computes: the second
    looks its prefix up at its first chunk, so it reuses the blocks the first computed."""
    engine = CausalLM(tiny_model_dir, "cpu", pool=KVPoolOptions(8 * MIB, 16, True))
    system, first_turn, second_turn = prompts_of((200, 30, 20), engine.vocab_size, seed=2)
    first = PromptPrefill(engine, system + first_turn, None, chunk=512)
    second = PromptPrefill(engine, system + second_turn, None, chunk=512)
    assert second.remaining == 220, "nothing cached yet"
    assert first.step() is not None and first.cached_tokens == 0
    assert second.remaining == 220 - 192, "what its first chunk will compute, the scheduler's order by it"
    computed = engine.pool.computed_prompt_tokens
    logits, _ = second.step()
    assert second.cached_tokens == 192, "the system prompt's full blocks"
    assert engine.pool.computed_prompt_tokens - computed == 220 - 192
    fresh_logits, fresh = engine.prefill(system + second_turn, cache_salt="uncached")
    torch.testing.assert_close(logits, fresh_logits, rtol=1e-4, atol=1e-4)
    for sequence in (first.sequence, second.sequence, fresh):
        sequence.release()


@pytest.mark.parametrize("c_kernels", [False, True])
def test_prompts_computed_in_one_pass_give_what_each_gives_alone(tiny_model_dir, c_kernels):
    """A pass of several prompts' chunks (prefill's batched pass): one fresh, one after a
    cached prefix, a one-token chunk, a middle chunk, each with the logits, greedy token and
    KV it gets in a pass of its own."""
    if c_kernels and cpu_kernels.load(cpu_kernels.library_dir()) is None:
        pytest.skip("no C kernels on this host")
    engine = CausalLM(tiny_model_dir, "cpu", pool=KVPoolOptions(8 * MIB, 16, True))
    if not c_kernels:
        engine._runner.kernels = None  # the torch path's attention
    assert engine.batches_prompts
    system, *tails = prompts_of((64, 40, 33, 1, 50), engine.vocab_size, seed=3)
    prompts = [system + tails[0], tails[1], tails[2], tails[3]]

    def warm_cache():
        engine.pool.clear_cache()
        _, held = engine.prefill(system + [7])
        held.release()

    def chunks_of(prefills):
        chunks = [prefill.next_chunk(greedy=index % 2 == 0) for index, prefill in enumerate(prefills)]
        return chunks, engine.prefill_chunks(chunks)

    warm_cache()
    alone = []
    for prompt in prompts:
        prefill = PromptPrefill(engine, prompt, None, chunk=30)  # the last prompt in two chunks
        while (last := prefill.step()) is None:
            pass
        alone.append((last[0], prefill.cached_tokens, engine.export_kv(prefill.sequence)))
        prefill.release()
    warm_cache()
    together = [PromptPrefill(engine, prompt, None, chunk=4096 if i < 3 else 30) for i, prompt in enumerate(prompts)]
    first = together[3].next_chunk()  # its first chunk alone: the pass below takes its middle one
    together[3].finish_chunk(engine.prefill_chunks([first])[0])
    chunks, computed = chunks_of(together)
    assert [len(ids) for _, ids, _ in chunks] == [40, 33, 1, 20]
    for index, (prefill, pair, (logits, cached, kv)) in enumerate(zip(together, computed, alone, strict=True)):
        last = prefill.finish_chunk(pair)
        assert last is not None, "each prompt's last chunk"
        assert prefill.cached_tokens == cached
        torch.testing.assert_close(engine.export_kv(prefill.sequence), kv, rtol=1e-4, atol=1e-5)
        if index % 2 == 0:
            assert last[1] == int(logits.argmax()), f"prompt {index}'s greedy token"
        if last[0] is not None:
            torch.testing.assert_close(last[0], logits, rtol=1e-4, atol=1e-4)
    for prefill in together:
        prefill.release()


def test_without_a_prefix_cache_no_prompt_waits_for_a_block_to_be_cached(tiny_model_dir):
    """uncached_block names the first block a prompt's first pass computes, for prefill to
    keep two prompts that share it out of one pass; with no prefix cache no later pass would
    find it cached, so there is none."""
    prompt = prompts_of((40,), 512, seed=4)[0]
    for caching, expected_blocks in ((True, 1), (False, 0)):
        engine = CausalLM(tiny_model_dir, "cpu", pool=KVPoolOptions(8 * MIB, 16, caching))
        prefill = PromptPrefill(engine, prompt, None, chunk=64)
        assert (prefill.uncached_block is not None) == bool(expected_blocks)
        prefill.release()


def test_eviction_under_a_small_pool_keeps_outputs_right_and_too_big_a_prompt_is_refused(tiny_model_dir, reference):
    per_block = 16 * CausalLM(tiny_model_dir, "cpu", pool=KVPoolOptions(MIB, 16)).kv_bytes_per_token()
    engine = CausalLM(tiny_model_dir, "cpu", pool=KVPoolOptions(30 * per_block, 16, True))
    prompts = prompts_of((200, 200, 200), engine.vocab_size, seed=2)
    for prompt in prompts + prompts[:1]:  # 13 blocks each in a 30-block pool: the first is evicted, then again
        logits, sequence = engine.prefill(prompt)
        assert int(logits.argmax()) == alone(reference, prompt, 1)[0]
        sequence.release()
    assert engine.pool.evictions > 0
    with pytest.raises(Unavailable, match="whole KV pool holds 30"):
        engine.prefill(list(range(1, 600)))
    assert engine.pool.usage().used_blocks == 0


def test_the_cpu_vocab_projection_gives_nn_linears_logits(tiny_model_dir, engine):
    """The row-major copy of the output weight (a faster GEMM on CPU) computes what the
    model's own nn.Linear does, for one row and for a batch."""
    linear = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).get_output_embeddings()
    head = engine.model.get_output_embeddings()
    assert type(head) is not torch.nn.Linear and type(linear) is torch.nn.Linear
    for rows in (1, 4, 16):
        hidden = torch.randn(rows, 1, linear.in_features, generator=torch.Generator().manual_seed(rows))
        with torch.inference_mode():
            ours, theirs = head(hidden), linear(hidden)
        assert ours.shape == theirs.shape
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-4)
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_gpt_oss_sliding_window_layers_and_sinks_decode_what_transformers_does():
    """GPT-OSS: a sliding-window layer (the window applied in attention over all blocks) and
    attention sinks, rows longer than the window beside a short one."""
    from pdchat import embedded, registry

    model_dir = embedded.ensure_model(registry.TINY_GPTOSS)
    engine = CausalLM(model_dir, "cpu", pool=KVPoolOptions(8 * MIB, 16, True))
    window = engine.model.config.sliding_window
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = prompts_of((window + 30, 7, 2 * window + 3), engine.vocab_size, seed=4)
    batch, tokens = DecodeBatch(engine), []
    for prompt in prompts:
        logits, sequence = engine.prefill(prompt)
        batch.join(sequence)
        tokens.append([int(logits.argmax())])
    for _ in range(7):
        for row, logits in zip(tokens, batch.step([t[-1] for t in tokens]), strict=True):
            row.append(int(logits.argmax()))
    assert tokens == [alone(reference, prompt, 8) for prompt in prompts]
