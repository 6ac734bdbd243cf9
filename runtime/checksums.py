"""A checkpoint's manifest: the SHA-256 of every file in it, written last, checked before use.

The manifest is `manifest.sha256` at the checkpoint's root, one line per file in the format
of `sha256sum` (`<hex digest>  <path relative to the root>`), so `sha256sum -c
manifest.sha256` checks a checkpoint by hand. A checkpoint is complete only with it.
Whoever loads files of a checkpoint (the controller its state, a trainer a training state,
a rollout engine an agent's weights) first checks them against their digests here, and a
file that does not match is an error naming it.

Hand-written over hashlib: a manifest is a few lines, and `sha256sum`'s format is the one
a user can check without FlexMARL. It knows nothing of what the files hold.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from .atomic import write_text_atomically

MANIFEST = "manifest.sha256"
_CHUNK = 1 << 20


class DamagedFile(Exception):
    """A file does not match its digest (or is missing, or the manifest is unreadable)."""

    def __init__(self, path: Path | str, why: str) -> None:
        super().__init__(f"{path} {why}")
        self.path = Path(path)


def sha256_file(path: Path | str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(root: Path) -> dict[str, str]:
    """Digests every file under `root` (but the manifest) and writes the manifest, synced,
    under a temporary name renamed into place."""
    entries = {rel: sha256_file(root / rel) for rel in _files(root)}
    text = "".join(f"{digest}  {rel}\n" for rel, digest in sorted(entries.items()))
    write_text_atomically(root / MANIFEST, text, durable=True)
    return entries


def read_manifest(root: Path) -> dict[str, str]:
    """Relative path -> digest. Raises DamagedFile when the manifest is missing or torn."""
    path = Path(root) / MANIFEST
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise DamagedFile(path, f"cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise DamagedFile(path, "is not text") from None
    entries = {}
    for number, line in enumerate(lines, 1):
        digest, sep, rel = line.partition("  ")
        if not sep or len(digest) != 64 or not rel or rel.startswith("/") or ".." in Path(rel).parts:
            raise DamagedFile(path, f"line {number} is not '<sha256>  <file>'")
        entries[rel] = digest
    if not entries:
        raise DamagedFile(path, "lists no file")
    return entries


def entries_under(entries: dict[str, str], folder: str) -> dict[str, str]:
    """The entries of the files in `folder` (relative to the manifest's root), with paths
    relative to that folder: what one agent's directory is checked against."""
    prefix = folder.rstrip("/") + "/"
    return {rel[len(prefix):]: digest for rel, digest in entries.items() if rel.startswith(prefix)}


def verify_files(root: Path | str, entries: dict[str, str]) -> None:
    """Checks every file of `entries` (path relative to `root` -> digest); raises
    DamagedFile naming the first that is missing or does not match."""
    root = Path(root)
    for rel, digest in sorted(entries.items()):
        path = root / rel
        try:
            actual = sha256_file(path)
        except FileNotFoundError:
            raise DamagedFile(path, "is missing (the checkpoint's manifest lists it)") from None
        except OSError as exc:
            raise DamagedFile(path, f"cannot be read ({exc.strerror or exc})") from None
        if actual != digest:
            raise DamagedFile(path, f"does not match its checksum in the checkpoint's manifest "
                                    f"(sha256 {actual[:12]}..., recorded {digest[:12]}...): it was changed "
                                    "or damaged after it was written")


def _files(root: Path) -> list[str]:
    found = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            if rel != MANIFEST:
                found.append(rel)
    return found
