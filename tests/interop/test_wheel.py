"""The pip route: `pyproject.toml` (maturin, `bindings = "bin"`) builds a wheel that holds the
`ckpt` binary; installed into a fresh venv it puts `ckpt` on that venv's PATH, and that `ckpt` is
the project's program (same version, same output, byte for byte, on the quick start).

The wheel is built with cargo's release profile in the repository's target directory (or
$CARGO_TARGET_DIR), so after `cargo build --release` (scripts/test does one) only the binary is
linked again: a few seconds, not a build from scratch.

What ships, by the wheel or by `cargo install`, carries no debug info: at most 25 MiB where the
release profile with `debug = 1` gave 110 MB (`--profile profiling` keeps it, for perf)."""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_helpers import FIXTURES_DIR, REPO
from conftest import run_ckpt


def pinned(name: str) -> str:
    """`name==X` as tests/interop/requirements.txt pins it."""
    for line in (REPO / "tests" / "interop" / "requirements.txt").read_text().splitlines():
        spec = line.split("#", 1)[0].strip()
        if spec.split("==")[0].strip().lower() == name:
            return spec
    raise AssertionError(f"{name} is not pinned in tests/interop/requirements.txt")


def maturin() -> Path:
    """The test venv's maturin (the build backend), installed at its pin if missing; skip when it
    cannot be had."""
    exe = Path(sys.executable).parent / "maturin"
    if not exe.is_file():
        spec = pinned("maturin")
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", spec], capture_output=True, text=True
        )
        if proc.returncode != 0 or not exe.is_file():
            pytest.skip(f"maturin cannot be installed ({spec}): {proc.stderr.strip()[-500:]}")
    return exe


# What a shipped binary may weigh: without debug info it is 19 MB, with it 110 MB.
SHIPPED_MAX_BYTES = 25 << 20


def elf_sections(path: Path) -> list:
    """The section names of the 64-bit little-endian ELF file at `path`, read from its section
    header table and section name string table."""
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, f"{path} is not a 64-bit LE ELF"
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_at, names_len = headers[shstrndx][4], headers[shstrndx][5]
    names = data[names_at : names_at + names_len]
    return [names[h[0] : names.index(b"\0", h[0])].decode() for h in headers]


def assert_fit_to_ship(path: Path, what: str) -> None:
    size = path.stat().st_size
    sections = elf_sections(path)
    assert ".text" in sections, f"{what}: no .text among {sections}: the ELF reader is wrong"
    debug = [s for s in sections if s.startswith(".debug_")]
    assert not debug, f"{what} carries debug info ({size / 2**20:.1f} MiB): {debug}"
    assert size <= SHIPPED_MAX_BYTES, f"{what} is {size / 2**20:.1f} MiB, over {SHIPPED_MAX_BYTES >> 20} MiB"


def cargo_version() -> str:
    text = (REPO / "Cargo.toml").read_text()
    return re.search(r'^version = "([^"]+)"', text, re.M).group(1)


def test_the_wheel_installs_ckpt_on_a_fresh_venvs_path(tmp_path):
    # maturin's build backend runs the `maturin` executable found on PATH.
    env = dict(
        os.environ,
        CARGO_TARGET_DIR=os.environ.get("CARGO_TARGET_DIR", str(REPO / "target")),
        PATH=f"{maturin().parent}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    wheels = tmp_path / "wheels"
    # What `pip install .` does, minus the download of maturin into an isolated build env: pip
    # reads pyproject.toml's build backend (maturin, release profile) and builds the wheel.
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--wheel-dir", str(wheels), str(REPO)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert build.returncode == 0, f"pip wheel failed:\n{build.stdout[-3000:]}\n{build.stderr[-6000:]}"
    (wheel,) = wheels.glob("*.whl")
    version = cargo_version()
    assert wheel.name.startswith(f"ckpt-{version}-py3-none-"), wheel.name

    # A venv of its own, with nothing in it but what the wheel brings.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    bin_dir = venv / "bin"
    assert not (bin_dir / "ckpt").exists()
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(bin_dir / "python"), "install",
         "--quiet", "--no-index", "--no-deps", str(wheel)],
        capture_output=True,
        text=True,
    )
    assert install.returncode == 0, install.stderr
    assert_fit_to_ship(bin_dir / "ckpt", "the wheel's ckpt")

    # `ckpt` found through PATH, as after `source venv/bin/activate`.
    path_env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin", NO_COLOR="1")

    def venv_ckpt(*args) -> subprocess.CompletedProcess:
        return subprocess.run(["ckpt", *map(str, args)], capture_output=True, text=True, env=path_env, cwd=tmp_path)

    got = venv_ckpt("--version")
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == f"ckpt {version}"

    dcp = FIXTURES_DIR / "fsdp2_adamw"
    got = venv_ckpt("inspect", dcp, "--json")
    want = run_ckpt("inspect", dcp, "--json")
    assert got.returncode == 0, got.stderr
    assert got.stdout == want.stdout
    assert '"format": "dcp"' in got.stdout

    # The README's quick start, from the venv, gives the bytes the project's own binary gives.
    quick = ["consolidate", dcp, "--include", "model.*", "--strip-prefix", "model.", "--quiet", "-o"]
    got = venv_ckpt(*quick, tmp_path / "wheel.safetensors")
    assert got.returncode == 0, got.stderr
    want = run_ckpt(*quick, tmp_path / "project.safetensors")
    assert want.returncode == 0, want.stderr
    assert (tmp_path / "wheel.safetensors").read_bytes() == (tmp_path / "project.safetensors").read_bytes()


def test_cargo_install_ships_a_binary_without_debug_info(tmp_path):
    # `cargo install` builds with the release profile; with the repository's target directory
    # only the binary is linked again after `cargo build --release`.
    root = tmp_path / "root"
    env = dict(os.environ, CARGO_TARGET_DIR=os.environ.get("CARGO_TARGET_DIR", str(REPO / "target")))
    install = subprocess.run(
        ["cargo", "install", "--quiet", "--locked", "--offline", "--path", str(REPO), "--root", str(root)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert install.returncode == 0, f"cargo install failed:\n{install.stderr[-6000:]}"
    assert_fit_to_ship(root / "bin" / "ckpt", "`cargo install`'s ckpt")
    # The profile for perf and valgrind is the release one plus debug info.
    manifest = (REPO / "Cargo.toml").read_text()
    assert re.search(r'^\[profile\.profiling\]\ninherits = "release"\ndebug = ', manifest, re.M), (
        "Cargo.toml has no [profile.profiling] that inherits release and keeps debug info"
    )
