"""The GGUF header of a file on the Hub, read with Range requests of its first bytes: what `dg info`
shows of a model not downloaded yet, without its weights.

The first request asks for 2 MiB; while the header goes on past what came, the next asks for the
bytes after them, as many again, up to MAX_HEADER_BYTES (a real model's header, its 262144-token
vocabulary and merges included, is some tens of MB at most). What the server sends is
checked: a 206 must start where it was asked to and give the file's size; a 200 (a server ignoring
Range) is read from its start only as far as the bytes asked for; nothing past them is read.
"""

from __future__ import annotations

import re

from dgcli import hub
from dgcli.hub import HubError, RemoteFile
from dgcli.modelfile.header import GgufHeader, HeaderGoesOn, parse_header_prefix

FIRST_REQUEST_BYTES = 2 << 20
MAX_HEADER_BYTES = 64 << 20
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


def _fetch_range(remote: RemoteFile, start: int, end: int) -> bytes:
    """Bytes [start, end) of the file: exactly those, or HubError."""
    from huggingface_hub import constants
    from huggingface_hub.utils import build_hf_headers, get_session

    where = f"{remote.repo}/{remote.filename}"
    want = end - start
    body = bytearray()
    try:
        with get_session().stream("GET", remote.url, headers={**build_hf_headers(), "Range": f"bytes={start}-{end - 1}"},
                                  follow_redirects=True, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as response:
            if response.status_code == 206:
                m = _CONTENT_RANGE.fullmatch(response.headers.get("Content-Range", "").strip())
                if m is None or int(m[1]) != start or (m[3] != "*" and int(m[3]) != remote.size):
                    raise HubError(f"the Hub answered a request for bytes {start}-{end - 1} of {where} with "
                                   f"another range ({response.headers.get('Content-Range', 'none')[:60]!r})")
            elif response.status_code != 200:
                raise HubError(f"the Hub answered HTTP {response.status_code} to a request for bytes "
                               f"{start}-{end - 1} of {where}")
            skip = start if response.status_code == 200 else 0  # a server ignoring Range sends the file from byte 0
            for chunk in response.iter_bytes():
                if skip:
                    dropped = min(skip, len(chunk))
                    chunk, skip = chunk[dropped:], skip - dropped
                body += chunk[: want - len(body)]
                if len(body) >= want:
                    break
    except HubError:
        raise
    except Exception as err:  # noqa: BLE001 - every failure becomes one line
        raise hub._network_or(err, remote.repo, remote.filename, target=f"the header of {where}") from None
    if len(body) < want:
        raise HubError(f"the Hub sent {len(body)} of the {want} bytes asked for from {where}")
    return bytes(body)


def read_remote_header(remote: RemoteFile, *, max_bytes: int | None = None) -> GgufHeader:
    """The header of `remote` (dgcli.hub.remote_file: its size and URL, checked). HubError when it
    cannot be fetched or is longer than `max_bytes` (MAX_HEADER_BYTES); ModelLoadError when it is malformed."""
    max_bytes = MAX_HEADER_BYTES if max_bytes is None else max_bytes
    name = f"{remote.repo}/{remote.filename}"
    data = b""
    want = min(FIRST_REQUEST_BYTES, remote.size, max_bytes)
    while True:
        if want > len(data):
            data += _fetch_range(remote, len(data), want)
        try:
            return parse_header_prefix(data, remote.size, name)
        except HeaderGoesOn:
            if len(data) >= min(remote.size, max_bytes):
                raise HubError(f"the GGUF header of {name} is longer than the {max_bytes >> 20} MiB dg reads "
                               "from the Hub") from None
            want = min(len(data) * 2, remote.size, max_bytes)
