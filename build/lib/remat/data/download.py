"""Download-and-verify helpers for ``scripts/prepare_<name>.py`` (users with internet).

Files are checked against Git blob hashes (``git hash-object``: SHA-1 of ``b"blob <size>\\0"``
followed by the bytes), which is what a public Git repository records for each file, so a
manifest can be checked against the repository itself. Nothing here runs in the tests' data
path; the tests only check the hashing and the verification on local files.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import urllib.parse
import urllib.request
from collections.abc import Mapping
from pathlib import Path


def git_blob_sha1(path: str | Path) -> str:
    """Git blob hash (40 hex digits) of a file, as ``git hash-object <path>`` prints it."""
    data = Path(path).read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def parse_manifest(text: str) -> dict[str, str]:
    """``"<sha1>  <relative path>"`` lines (blank lines skipped) -> ``{path: sha1}``.

    Raises:
        ValueError: a line without a 40-hex-digit hash and a path; names the line.
    """
    manifest = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        digest, _, path = line.strip().partition("  ")
        if len(digest) != 40 or not path or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError(f"manifest line {number} is not '<sha1>  <path>': {line!r}")
        manifest[path] = digest
    return manifest


def verify_tree(root: str | Path, manifest: Mapping[str, str]) -> list[str]:
    """Check every manifest file under ``root``.

    Returns:
        Problems, one line each (``"missing: <path>"`` or ``"hash mismatch: <path>"``); an
        empty list when every file is present with its hash.
    """
    root = Path(root)
    problems = []
    for rel, digest in sorted(manifest.items()):
        path = root / rel
        if not path.is_file():
            problems.append(f"missing: {rel}")
        elif git_blob_sha1(path) != digest:
            problems.append(f"hash mismatch: {rel}")
    return problems


def fetch_tree(base_url: str, root: str | Path, manifest: Mapping[str, str],
               timeout_s: float = 60.0) -> int:
    """Download the manifest's files that are missing or wrong under ``root``.

    Each file comes from ``base_url + <url-quoted relative path>`` and is written only after
    its Git blob hash matches. Returns the number of files downloaded.

    Raises:
        RuntimeError: a downloaded file has the wrong hash (names the URL and both hashes).
        urllib.error.URLError: the download fails.
    """
    root = Path(root)
    fetched = 0
    for rel, digest in sorted(manifest.items()):
        path = root / rel
        if path.is_file() and git_blob_sha1(path) == digest:
            continue
        url = base_url + urllib.parse.quote(rel)
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            data = response.read()
        got = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        if got != digest:
            raise RuntimeError(f"{url}: Git blob hash {got}, expected {digest}; not written")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        fetched += 1
    return fetched


def prepare_main(doc: str, folder: str, base_url: str, manifest: Mapping[str, str],
                 argv: list[str] | None = None) -> int:
    """Command line of ``scripts/prepare_<name>.py``: download (unless ``--verify-only``)
    into ``--dest`` (default ``$REMAT_DATA_DIR/<folder>``, else ``data/<folder>``), then
    verify every manifest file.

    Args:
        doc: the script's docstring; its first line is the ``--help`` description.
        folder: the dataset's folder name.
        base_url, manifest: as for :func:`fetch_tree`.
        argv: the arguments (None: ``sys.argv[1:]``).

    Returns:
        The exit status: 0 when every file is present with its hash, else 1 (the problems
        are printed to stderr).
    """
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    default = Path(os.environ.get("REMAT_DATA_DIR", "data")) / folder
    parser.add_argument("--dest", type=Path, default=default,
                        help=f"dataset folder to fill (default: {default})")
    parser.add_argument("--verify-only", action="store_true",
                        help="only check the files already in --dest")
    args = parser.parse_args(argv)
    if not args.verify_only:
        fetched = fetch_tree(base_url, args.dest, manifest)
        print(f"downloaded {fetched} file(s) into {args.dest}")
    problems = verify_tree(args.dest, manifest)
    for line in problems:
        print(line, file=sys.stderr)
    print(f"{len(manifest) - len(problems)}/{len(manifest)} files verified in {args.dest}")
    return 1 if problems else 0
