"""The agent wheel a node gets: the denv-agent installed beside denv-iac here, packed as a wheel.

No package index holds denv-agent, so a node never installs it by name: the deploy uploads this
wheel. It is packed from the installed agent's own files and metadata, whether that came from
the built wheels, a checkout or a git URL, so a node runs the agent `denv --version` names.
"""

import base64
import hashlib
import io
import zipfile
from importlib.metadata import distribution
from pathlib import Path

DIST = "denv-agent"
TAG = "py3-none-any"
WHEEL = f"Wheel-Version: 1.0\nGenerator: denv-iac\nRoot-Is-Purelib: true\nTag: {TAG}\n"
# Fixed entry times: the same agent packs to the same bytes, so a node that has it sees no change.
EPOCH = (1980, 1, 1, 0, 0, 0)


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return f"sha256={digest.decode()}"


def agent_wheel() -> tuple[str, bytes]:
    """The wheel's file name and its bytes."""
    import denv_agent  # found through the install, an editable one included

    dist = distribution(DIST)
    package = Path(denv_agent.__file__).parent
    files = {
        f"denv_agent/{path.relative_to(package).as_posix()}": path.read_bytes()
        for path in sorted(package.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    }
    info = f"denv_agent-{dist.version}.dist-info"
    for name in ("METADATA", "entry_points.txt"):
        text = dist.read_text(name)
        if text is not None:
            files[f"{info}/{name}"] = text.encode()
    files[f"{info}/WHEEL"] = WHEEL.encode()
    record = [f"{name},{_record_hash(data)},{len(data)}" for name, data in files.items()]
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,", ""]).encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as wheel:
        for name, data in files.items():
            entry = zipfile.ZipInfo(name, EPOCH)
            entry.external_attr = 0o644 << 16
            wheel.writestr(entry, data, zipfile.ZIP_DEFLATED)
    return f"denv_agent-{dist.version}-{TAG}.whl", buffer.getvalue()
