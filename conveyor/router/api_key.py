"""Where the ingress's API key comes from, other than the command line (which every user of the host can read in
the process list): $CONVEYOR_API_KEY, or a file (`--api-key-file`, a mounted Kubernetes Secret)."""
from __future__ import annotations

from pathlib import Path

from conveyor import envs

API_KEY_ENV = envs.API_KEY


def read_api_key_file(path: str | Path) -> str:
    """The key in `path`, surrounding whitespace (a trailing newline) removed; ValueError if it is unreadable or
    empty, so a missing Secret fails the start rather than serving without a key."""
    try:
        key = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the API key file {str(path)!r}: {exc}") from None
    if not key:
        raise ValueError(f"the API key file {str(path)!r} is empty")
    return key
