"""The Kubernetes manifests hold together: valid against the Kubernetes schema (offline),
every pdchat command parses with pdchat's own CLI, vllm-router's selectors find the pods,
and every Secret and port a probe names exists."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pdchat.cli import build_parser
from pdchat.core.settings import DRAIN_TIMEOUT_S

MANIFEST = Path(__file__).resolve().parents[2] / "deploy/k8s/pdchat.yaml"
DOCUMENTS = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
DEPLOYMENTS = {d["metadata"]["name"]: d for d in DOCUMENTS if d["kind"] == "Deployment"}


def containers():
    for deployment in DEPLOYMENTS.values():
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            yield deployment, container


@pytest.mark.parametrize("document", DOCUMENTS, ids=[f"{d['kind']}/{d['metadata']['name']}" for d in DOCUMENTS])
def test_valid_against_the_kubernetes_schema(document):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kubernetes_validate.validate(document, "1.37.0", strict=True)


def test_every_pdchat_command_parses():
    commands = [c["command"] for _, c in containers() if c["command"][0] == "pdchat"]
    assert {c[1] for c in commands} == {"serve", "openai"}
    for command in commands:
        build_parser().parse_args(command[1:])  # exits (fails the test) on an unknown flag


def test_roles_fronts_and_selectors_line_up():
    [router] = [c for _, c in containers() if c["name"] == "vllm-router"]
    args = router["command"]
    for role in ("prefill", "decode"):
        selector = args[args.index(f"--{role}-selector") + 1 : args.index(f"--{role}-selector") + 3]
        labels = DEPLOYMENTS[f"pdchat-{role}"]["spec"]["template"]["metadata"]["labels"]
        assert selector == [f"{k}={v}" for k, v in labels.items()]
        serve = next(
            c for _, c in containers() if c["name"] == "tritonserver" and f"--role={role}" in "=".join(c["command"])
        )
        assert serve["command"][serve["command"].index("--role") + 1] == role
    front_port = {c["ports"][0]["containerPort"] for _, c in containers() if c["name"] == "openai"}
    assert front_port == {int(args[args.index("--service-discovery-port") + 1])}


def test_probes_name_declared_ports_and_the_key_comes_from_a_secret():
    for _, container in containers():
        ports = {p["name"] for p in container.get("ports", [])}
        for probe in ("readinessProbe", "livenessProbe"):
            if probe in container:
                assert container[probe]["httpGet"]["port"] in ports
        for env in container.get("env", []):
            if env["name"] == "PDCHAT_HANDOFF_KEY":
                assert env["valueFrom"]["secretKeyRef"] == {"name": "pdchat-handoff-key", "key": "key"}


def test_each_server_stops_after_its_front_drained():
    """tritonserver's preStop drains the pod's OpenAI front (docs/supervision.md#draining),
    within the pod's grace period."""
    for name in ("pdchat-prefill", "pdchat-decode"):
        pod = DEPLOYMENTS[name]["spec"]["template"]["spec"]
        containers = {c["name"]: c for c in pod["containers"]}
        port = containers["openai"]["ports"][0]["containerPort"]
        hook = " ".join(containers["tritonserver"]["lifecycle"]["preStop"]["exec"]["command"])
        assert f"'http://127.0.0.1:{port}/drain', method='POST'" in hook
        assert pod["terminationGracePeriodSeconds"] > DRAIN_TIMEOUT_S.default_value
