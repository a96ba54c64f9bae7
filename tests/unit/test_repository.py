"""The model repository's configs agree with the tensor names the code uses."""

from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from pdchat import tensors

REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"


def load(name):
    config = model_config_pb2.ModelConfig()
    text_format.Parse((REPOSITORY / name / "config.pbtxt").read_text(), config)
    return config


def names(entries):
    return [e.name for e in entries]


CLIENT_INPUTS = [tensors.REQUEST, tensors.TEXT_INPUT, *tensors.SCALAR_INPUTS]
CLIENT_OUTPUTS = [tensors.TEXT_OUTPUT, tensors.RESPONSE, tensors.PROMPT_TOKEN_IDS, tensors.OUTPUT_TOKEN_IDS, tensors.FINISH_REASON]


@pytest.mark.parametrize("model", ["renderer", "prefill", "decode", "chat_ensemble"])
def test_config_names_itself_after_its_directory(model):
    assert load(model).name == model


def test_chat_has_the_ensemble_contract_plus_forwarded_ids():
    chat = load("chat")
    assert names(chat.input) == CLIENT_INPUTS + [tensors.PROMPT_TOKEN_IDS, tensors.KV_TRANSFER_PARAMS]
    assert names(chat.output) == CLIENT_OUTPUTS + [tensors.KV_TRANSFER_PARAMS]
    decode_role = model_config_pb2.ModelConfig()
    text_format.Parse((REPOSITORY / "chat/configs/decode.pbtxt").read_text(), decode_role)
    assert names(decode_role.input) == names(chat.input) and names(decode_role.output) == names(chat.output)
    assert decode_role.parameters[tensors.PARAM_FORWARDED_IDS].string_value == "signed"


def test_client_contract_is_the_same_on_renderer_and_ensemble():
    assert names(load("renderer").input) == CLIENT_INPUTS == names(load("chat_ensemble").input)
    assert names(load("decode").output) == CLIENT_OUTPUTS == names(load("chat_ensemble").output)
    for entry in load("chat_ensemble").input:
        assert entry.optional and list(entry.dims) == [1]


def test_stage_tensors():
    assert names(load("renderer").output) == [tensors.PROMPT_TOKEN_IDS, tensors.GENERATION_PARAMS]
    assert names(load("prefill").input) == [tensors.PROMPT_TOKEN_IDS, tensors.GENERATION_PARAMS, tensors.KV_DESTINATION]
    assert names(load("prefill").output) == [tensors.FIRST_TOKEN_ID, tensors.KV_CACHE, tensors.KV_HANDLE]
    assert names(load("decode").input) == [
        tensors.PROMPT_TOKEN_IDS, tensors.GENERATION_PARAMS, tensors.KV_CACHE, tensors.FIRST_TOKEN_ID,
        tensors.KV_HANDLE, tensors.CANCEL_REQUEST_ID]
    assert load("decode").model_transaction_policy.decoupled


def test_ensemble_wires_every_stage_input_from_an_earlier_output():
    produced = set(CLIENT_INPUTS)
    for step in load("chat_ensemble").ensemble_scheduling.step:
        stage = load(step.model_name)
        required = {i.name for i in stage.input if not i.optional}
        assert required <= set(step.input_map) <= set(names(stage.input))
        assert set(step.input_map.values()) <= produced
        assert set(step.output_map) <= set(names(stage.output))
        produced |= set(step.output_map.values())
    assert set(CLIENT_OUTPUTS) <= produced
    decode_step = load("chat_ensemble").ensemble_scheduling.step[-1]
    # Within one server the KV travels as a tensor, with prefill's first token.
    assert {tensors.KV_CACHE, tensors.FIRST_TOKEN_ID} <= set(decode_step.input_map)
