"""assemble_backend_dir: the python backend's files copied from the wheel, by servers that start at once."""

import threading

from pdchat import launcher


def _wheel(root):
    """A stand-in pytriton root holding the three files the backend directory takes."""
    backend = root / "tritonserver/backends/python"
    backend.mkdir(parents=True)
    (backend / "libtriton_python.so").write_bytes(b"\x7fELF" + bytes(200_000))
    (backend / "triton_python_backend_utils.py").write_text("# utils\n")
    version = launcher.sys.version_info
    stub = root / f"tritonserver/python_backend_stubs/{version.major}.{version.minor}"
    stub.mkdir(parents=True)
    (stub / "triton_python_backend_stub").write_bytes(bytes(300_000))
    return root


def test_threads_assembling_at_once_each_get_the_whole_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("PDCHAT_CACHE_DIR", str(tmp_path / "cache"))
    root = _wheel(tmp_path / "pytriton")
    start = threading.Barrier(8)
    errors: list[BaseException] = []
    targets = []

    def assemble() -> None:
        start.wait()
        try:
            targets.append(launcher.assemble_backend_dir(root))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=assemble) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(set(targets)) == 1
    python_dir = targets[0] / "python"
    assert sorted(path.name for path in python_dir.iterdir()) == [
        "libtriton_python.so",
        "triton_python_backend_stub",
        "triton_python_backend_utils.py",
    ]  # no temporary left behind
    assert (python_dir / "libtriton_python.so").read_bytes() == (
        root / "tritonserver/backends/python/libtriton_python.so"
    ).read_bytes()
