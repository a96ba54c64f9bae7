"""The model repository's configs agree with the tensor names the code uses."""

from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from pdchat import tensors
from pdchat.core import settings

REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"


def load(name):
    config = model_config_pb2.ModelConfig()
    text_format.Parse((REPOSITORY / name / "config.pbtxt").read_text(), config)
    return config


def names(entries):
    return [e.name for e in entries]


CLIENT_INPUTS = [tensors.REQUEST, tensors.TEXT_INPUT, *tensors.SCALAR_INPUTS]
CLIENT_OUTPUTS = [
    tensors.TEXT_OUTPUT,
    tensors.RESPONSE,
    tensors.PROMPT_TOKEN_IDS,
    tensors.OUTPUT_TOKEN_IDS,
    tensors.FINISH_REASON,
]


@pytest.mark.parametrize("model", ["renderer", "prefill", "decode", "chat_ensemble", "chat"])
def test_config_names_itself_after_its_directory(model):
    assert load(model).name == model


def specs(entries):
    """Config entries in tensors.TensorSpec form (data type, dims, optional)."""
    return [
        tensors.TensorSpec(
            e.name, model_config_pb2.DataType.Name(e.data_type), tuple(e.dims), getattr(e, "optional", False)
        )
        for e in entries
    ]


@pytest.mark.parametrize("role", ["config.pbtxt", "configs/prefill.pbtxt", "configs/decode.pbtxt"])
def test_chat_configs_leave_the_contract_to_tensors_py(role):
    config = model_config_pb2.ModelConfig()
    text_format.Parse((REPOSITORY / "chat" / role).read_text(), config)
    assert config.name == "chat" and not config.input and not config.output  # declared by auto_complete_config
    policy = {"config.pbtxt": "", "configs/prefill.pbtxt": "off", "configs/decode.pbtxt": "signed"}[role]
    assert config.parameters[settings.FORWARDED_IDS.param].string_value == policy


def test_chat_is_the_ensemble_contract_plus_completions_forwarded_ids_and_tickets():
    ensemble = load("chat_ensemble")
    chat_only = [tensors.COMPLETION_REQUEST, tensors.PROMPT_TOKEN_IDS, tensors.KV_TRANSFER_PARAMS]
    assert list(tensors.CHAT_INPUTS) == specs(ensemble.input) + [s for s in tensors.CHAT_INPUTS if s.name in chat_only]
    ticket_only = [
        tensors.KV_TRANSFER_PARAMS,
        tensors.GENERATION_PARAMS,
        tensors.KV_HANDLE,
        tensors.STAGE_SEAL,
        tensors.FIRST_OUTPUT_SENT,
        tensors.FEED_SEAL,
    ]
    assert list(tensors.CHAT_OUTPUTS) == specs(ensemble.output) + [
        s for s in tensors.CHAT_OUTPUTS if s.name in ticket_only
    ]


def test_a_ticket_is_decodes_inputs_as_chat_outputs():
    decode_inputs = {entry.name: entry for entry in load("decode").input}
    chat_outputs = {spec.name: spec for spec in tensors.CHAT_OUTPUTS}
    for name in tensors.DECODE_TICKET_OUTPUTS:
        assert chat_outputs[name].data_type == model_config_pb2.DataType.Name(decode_inputs[name].data_type)
        assert list(chat_outputs[name].dims) == list(decode_inputs[name].dims)
    assert set(tensors.DECODE_TICKET_OUTPUTS) == set(decode_inputs) - {tensors.CANCEL_REQUEST_ID}


def test_client_contract_is_the_same_on_renderer_and_ensemble():
    from_chat = [tensors.CHAT_REQUEST, tensors.STAGE_SEAL]
    from_router = [tensors.TOKENIZE_REQUEST, tensors.DETOKENIZE_REQUEST]
    assert names(load("renderer").input) == CLIENT_INPUTS + from_chat + from_router
    assert names(load("chat_ensemble").input) == CLIENT_INPUTS
    assert names(load("chat_ensemble").output) == CLIENT_OUTPUTS
    assert names(load("decode").output) == CLIENT_OUTPUTS + list(tensors.DECODE_FEED_OUTPUTS)
    for entry in load("chat_ensemble").input:
        assert entry.optional and list(entry.dims) == [1]


def test_stage_tensors_and_seals():
    assert names(load("renderer").output) == [
        tensors.PROMPT_TOKEN_IDS,
        tensors.GENERATION_PARAMS,
        tensors.STAGE_SEAL,
        tensors.RESPONSE,
    ]
    assert names(load("prefill").input) == [
        tensors.PROMPT_TOKEN_IDS,
        tensors.GENERATION_PARAMS,
        tensors.KV_DESTINATION,
        tensors.STAGE_SEAL,
    ]
    assert names(load("prefill").output) == [
        tensors.FIRST_TOKEN_ID,
        tensors.KV_HANDLE,
        tensors.STAGE_SEAL,
        tensors.FIRST_OUTPUT,
    ]
    assert names(load("decode").input) == [
        tensors.PROMPT_TOKEN_IDS,
        tensors.GENERATION_PARAMS,
        tensors.KV_HANDLE,
        tensors.CANCEL_REQUEST_ID,
        tensors.FIRST_OUTPUT_SENT,
        tensors.STAGE_SEAL,
    ]
    assert load("decode").model_transaction_policy.decoupled
    for stage in ("prefill", "decode"):  # no way in without a seal
        [seal] = [e for e in load(stage).input if e.name == tensors.STAGE_SEAL]
        assert not seal.optional


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
    # Within one server the KV travels by its sealed handle too: decode takes no KV tensor.
    assert {tensors.KV_HANDLE, tensors.STAGE_SEAL} <= set(decode_step.input_map)
    assert (
        decode_step.input_map[tensors.STAGE_SEAL]
        != load("chat_ensemble").ensemble_scheduling.step[1].input_map[tensors.STAGE_SEAL]
    )
