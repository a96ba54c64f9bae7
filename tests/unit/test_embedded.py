"""The embedded test models are rebuilt byte for byte from their pinned inputs."""

import hashlib


def digests(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


def test_tiny_model_rebuilds_identically(tiny_model_dir, tmp_path):
    from pdchat import embedded

    embedded.build_tiny(tmp_path)
    assert digests(tmp_path) == digests(tiny_model_dir)
    assert "model.safetensors" in digests(tmp_path) and "chat_template.jinja" in digests(tmp_path)


def test_tiny_gptoss_rebuilds_identically(tmp_path):
    from pdchat import embedded, registry

    built = embedded.ensure_model(registry.TINY_GPTOSS)
    embedded.build_tiny_gptoss(tmp_path)
    assert digests(tmp_path) == digests(built)
    assert {"model.safetensors", "tokenizer.json"} <= set(digests(tmp_path))
