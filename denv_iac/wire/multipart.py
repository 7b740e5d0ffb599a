"""A transcription's upload: a multipart/form-data body of plain fields and one `file` part,
written by the load generator and read by the simulated replica (and the espeak transcriber)."""

from collections.abc import Mapping
from dataclasses import dataclass
from email.message import EmailMessage
from email.parser import BytesParser
from email.policy import HTTP


@dataclass(frozen=True)
class Upload:
    """One file part of a multipart form, and the form's plain fields."""

    fields: dict[str, str]
    filename: str
    audio: bytes


def form_data(
    boundary: str, fields: Mapping[str, str], filename: str, file_type: str, content: bytes
) -> tuple[str, bytes]:
    """The Content-Type and body of a form of `fields`, then the `file` part (`filename`, of
    `file_type`), as OpenAI's clients send a transcription."""
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
        for name, value in fields.items()
    ]
    parts.append(
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"\r\n'
        f"Content-Type: {file_type}\r\n\r\n".encode()
        + content
        + b"\r\n"
    )
    parts.append(f"--{boundary}--\r\n".encode())
    return f"multipart/form-data; boundary={boundary}", b"".join(parts)


def parse_multipart(content_type: str, body: bytes) -> Upload:
    """The form fields and the `file` part, read by the standard library's MIME parser;
    ValueError when the body is not such a form."""
    if (
        not content_type.lower().startswith("multipart/form-data")
        or "boundary=" not in content_type
    ):
        raise ValueError("send multipart/form-data with a boundary")
    head = f"Content-Type: {content_type}\r\n\r\n".encode("latin-1", "replace")
    form = BytesParser(policy=HTTP).parsebytes(head + body)
    if not isinstance(form, EmailMessage) or not form.is_multipart():
        raise ValueError("send multipart/form-data with a boundary")
    fields: dict[str, str] = {}
    upload: tuple[str, bytes] | None = None
    for part in form.iter_parts():
        name = part.get_param("name", header="content-disposition")
        content = part.get_payload(decode=True)
        if not isinstance(name, str) or not isinstance(content, bytes):
            continue
        if name == "file":
            upload = (part.get_filename() or "", content)
        else:
            fields[name] = content.decode("utf-8", "replace")
    if upload is None:
        raise ValueError("the form has no file part")
    return Upload(fields, *upload)
