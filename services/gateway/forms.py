"""`multipart/form-data` bodies (RFC 7578), as OpenAI's `POST /v1/images/edits` sends them:
text fields and uploaded files, turned into the JSON-like document protocol.image_job reads.

Parsed here rather than by a form library: the body is already in memory and bounded, the
parts are split on their boundary in one pass (no per-line parsing of megabytes of image),
and each part's headers are read by the standard library's header parser.
"""

from __future__ import annotations

import re
from email.message import Message
from email.parser import BytesHeaderParser
from email.policy import HTTP
from typing import Any

from omni_common.errors import InvalidArgument
from services.gateway.protocol import BadField, text_field

MAX_PARTS = 64
# Fields whose text is a number or a boolean in the JSON API (a form sends every field as text).
INT_FIELDS = ("n", "seed", "num_inference_steps", "preview_every", "partial_images")
FLOAT_FIELDS = ("guidance_scale", "true_cfg_scale")
BOOL_FIELDS = ("stream",)
IMAGE_FIELDS = ("image", "image[]")


def boundary_of(content_type: str) -> str:
    """The boundary of a `multipart/form-data` Content-Type, or 400."""
    header = Message()
    header["content-type"] = content_type
    boundary = header.get_param("boundary")
    if header.get_content_type() != "multipart/form-data" or not isinstance(boundary, str) or not boundary:
        raise InvalidArgument("this route takes multipart/form-data with a boundary (OpenAI's shape)")
    if len(boundary) > 70:  # RFC 2046's limit
        raise InvalidArgument("the multipart boundary is over 70 characters")
    return boundary


def parse_form(content_type: str, body: bytes) -> tuple[dict[str, str], list[bytes]]:
    """The form's text fields (the last of a name wins) and its uploaded images, in order."""
    delimiter = b"\r\n--" + boundary_of(content_type).encode("latin-1")
    chunks = (b"\r\n" + body).split(delimiter)
    if len(chunks) < 3 or not chunks[-1].startswith(b"--"):
        raise InvalidArgument("the multipart body is cut short (no closing boundary)")
    if len(chunks) - 2 > MAX_PARTS:
        raise InvalidArgument(f"the form has over {MAX_PARTS} parts")
    fields: dict[str, str] = {}
    images: list[bytes] = []
    for chunk in chunks[1:-1]:
        head, sep, content = chunk.removeprefix(b"\r\n").partition(b"\r\n\r\n")
        if not sep:
            raise InvalidArgument("a multipart part has no blank line after its headers")
        headers = BytesHeaderParser(policy=HTTP).parsebytes(head + b"\r\n\r\n")
        name = headers.get_param("name", header="content-disposition")
        if not isinstance(name, str):
            raise InvalidArgument("a multipart part has no name (Content-Disposition: form-data; name=...)")
        if name in IMAGE_FIELDS:
            images.append(content)
            continue
        try:
            fields[name] = text_field(name, content.decode("utf-8"))
        except UnicodeDecodeError:
            raise BadField(name, f"{name[:40]} is not UTF-8 text") from None
    return fields, images


def form_document(fields: dict[str, str]) -> dict[str, Any]:
    """The form's fields with the types the JSON API gives them (a bad number is 400)."""
    doc: dict[str, Any] = dict(fields)
    for name in INT_FIELDS:
        if name in fields:
            text = fields[name].strip()
            if not re.fullmatch(r"-?[0-9]{1,24}", text):
                raise BadField(name, f"{name} must be an integer, not {text[:40]!r}")
            doc[name] = int(text)
    for name in FLOAT_FIELDS:
        if name in fields:
            try:
                doc[name] = float(fields[name])
            except ValueError:
                raise BadField(name, f"{name} must be a number, not {fields[name][:40]!r}") from None
    for name in BOOL_FIELDS:
        if name in fields:
            if fields[name].lower() not in ("true", "false"):
                raise BadField(name, f"{name} must be true or false, not {fields[name][:40]!r}")
            doc[name] = fields[name].lower() == "true"
    return doc
