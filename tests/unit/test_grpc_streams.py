"""The requests the streams' loop sends: inputs as raw contents, parameters by type, and the
empty final response every stream relies on to know a request ended."""

import numpy as np
import pytest
from tritonclient.utils import deserialize_bytes_tensor

from pdchat.clients.grpc_streams import infer_request


def test_inputs_go_as_raw_contents_in_order():
    arrays = {
        "request": np.array([b'{"a": 1}'], dtype=np.object_),
        "prompt_token_ids": np.array([3, 1, 4], dtype=np.int32),
        "flag": np.array([True]),
    }
    request = infer_request("chat", arrays, ["response"], "r-1", {})
    assert (request.model_name, request.id) == ("chat", "r-1")
    assert [(t.name, t.datatype, list(t.shape)) for t in request.inputs] == [
        ("request", "BYTES", [1]),
        ("prompt_token_ids", "INT32", [3]),
        ("flag", "BOOL", [1]),
    ]
    raw = request.raw_input_contents
    assert deserialize_bytes_tensor(raw[0]).tolist() == [b'{"a": 1}']
    assert np.frombuffer(raw[1], dtype=np.int32).tolist() == [3, 1, 4]
    assert np.frombuffer(raw[2], dtype=np.bool_).tolist() == [True]
    assert [output.name for output in request.outputs] == ["response"]


def test_no_outputs_named_asks_for_all():
    assert len(infer_request("chat", {}, None, "", {}).outputs) == 0


def test_parameters_keep_their_type_and_an_empty_final_response_is_asked_for():
    request = infer_request("decode", {}, None, "", {"on": True, "ms": 250, "rate": 0.5, "name": "x"})
    parameters = request.parameters
    assert parameters["on"].WhichOneof("parameter_choice") == "bool_param" and parameters["on"].bool_param
    assert parameters["ms"].int64_param == 250
    assert parameters["rate"].double_param == 0.5
    assert parameters["name"].string_param == "x"
    assert parameters["triton_enable_empty_final_response"].bool_param


def test_a_parameter_of_another_type_is_refused_by_name():
    with pytest.raises(TypeError, match="'limits'"):
        infer_request("chat", {}, None, "", {"limits": [1, 2]})
