"""DecodeBatch: rows of different lengths joining and leaving mid-way decode exactly the
tokens each would alone (greedy, fp32, CPU)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdchat.core.generation.engine import CausalLM, DecodeBatch

STEPS = 16


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return CausalLM(tiny_model_dir, "cpu")


def alone(engine, prompt):
    result = engine.prefill(prompt)
    token, out = int(result.last_logits.argmax()), []
    for _ in range(STEPS):
        out.append(token)
        token = int(engine.step(token, result.cache).argmax())
    return out


# Small room: the storage grows (and shrinks) mid-way, often.
@pytest.mark.parametrize(
    ("spare_columns", "spare_rows"), [(DecodeBatch.SPARE_COLUMNS, DecodeBatch.SPARE_ROWS), (3, 0), (3, 1)]
)
def test_joining_and_leaving_rows_decode_what_each_would_alone(engine, spare_columns, spare_rows, monkeypatch):
    monkeypatch.setattr(DecodeBatch, "SPARE_COLUMNS", spare_columns)
    monkeypatch.setattr(DecodeBatch, "SPARE_ROWS", spare_rows)
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, engine.vocab_size, (n,), generator=generator).tolist() for n in (5, 40, 17, 300, 2, 90, 64, 11)
    ]
    expected = [alone(engine, p) for p in prompts]
    batch, rows, results, waiting, turn = DecodeBatch(engine), [], {}, list(range(len(prompts))), 0
    while waiting or rows:
        if waiting and turn % 3 == 0:  # a new request joins every third step
            index = waiting.pop(0)
            result = engine.prefill(prompts[index])
            batch.join(result.cache)
            rows.append((index, [int(result.last_logits.argmax())]))
        done = [
            row for row, (index, tokens) in enumerate(rows) if len(tokens) >= STEPS - index % 4
        ]  # leave at different times
        results.update(rows[row] for row in done)
        batch.leave(done)
        rows = [r for row, r in enumerate(rows) if row not in done]
        if rows:
            for (_, tokens), logits in zip(rows, batch.step([tokens[-1] for _, tokens in rows]), strict=True):
                tokens.append(int(logits.argmax()))
        turn += 1
    for index in range(len(prompts)):
        assert results[index] == expected[index][: len(results[index])], f"prompt {index} diverged in the batch"
    assert len(batch) == 0 and batch.kv_bytes() == 0


def test_the_batch_drops_padding_once_the_longest_row_leaves(engine):
    batch = DecodeBatch(engine)
    batch.join(engine.prefill(list(range(1, 300))).cache)
    batch.join(engine.prefill([5, 6, 7]).cache)
    assert batch.columns == 299
    batch.leave([0])
    assert batch.columns == 3 and batch.kv_bytes() == 3 * engine.kv_bytes_per_token()


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


def test_rows_join_into_free_room_and_leave_in_place(engine):
    """Within its room the batch's KV storage stays put: a join writes one row, a leave
    moves rows down; neither copies the batch into new storage."""
    batch = DecodeBatch(engine)
    for length in (50, 40, 45):
        batch.join(engine.prefill(list(range(1, length))).cache)

    def storage():
        return batch._cache.layers[0].keys.untyped_storage().data_ptr()

    before = storage()
    batch.leave([1])
    batch.join(engine.prefill(list(range(1, 30))).cache)
    batch.step([1, 2, 3])
    assert storage() == before and len(batch) == 3 and batch.columns == 50
    batch.join(engine.prefill(list(range(1, 200))).cache)  # longer than the room on the left: new storage
    assert storage() != before and batch.columns == 199


def test_the_storage_shrinks_when_most_rows_leave(engine):
    """Room is bounded: once more than 2 x SPARE_ROWS rows lie unused, the storage shrinks."""
    batch = DecodeBatch(engine)
    for length in range(40, 52):
        batch.join(engine.prefill(list(range(1, length))).cache)
    batch.leave(list(range(10)))
    keys = batch._cache.layers[0].keys
    most = (
        (len(batch) + 2 * DecodeBatch.SPARE_ROWS)
        * keys.shape[1]
        * (batch.columns + 2 * DecodeBatch.SPARE_COLUMNS)
        * keys.shape[3]
    )
    assert len(batch) == 2 and keys.untyped_storage().nbytes() <= most * keys.element_size()
