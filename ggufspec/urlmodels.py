"""GGUF files from a plain URL (llama.cpp's -mu/--model-url), kept in the store beside the hub's.

A URL's file goes to models/web-HOST[-PORT]-HASH/NAME, NAME the last segment of its path as llama.cpp
names it (without query or fragment), checked as a hub's file names are, HASH a short hash of the
folder path before it. The folder's name holds no
"__", so `list` never takes it for a hub repository's. The store pulls it as any other file: into a
partial download that the next pull resumes, its size checked against what the server announced,
verified by sha256 where the server gives one (the hub's own URLs), else checked to begin as a GGUF
file; then its sha256 is noted. The URL (without credentials, query or fragment) is the file's
revision: the same name from another URL is another file, downloaded again. A split GGUF's other
shards are fetched beside the one named, as llama.cpp does. The Hugging Face token goes to the hub's
own URLs only.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import re
import sys
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from .errors import BadReferenceError, StoreError, UnsafeNameError
from .huberrors import at_hub, hub_errors, origin
from .hubnames import MAX_FILE_BYTES, MAX_SEGMENT, contained, models_dir, unsafe_file_reason, with_shards
from .registry import ModelEntry
from .verified import record_verified, verified_files

URL_REFERENCE = re.compile(r"^https?://", re.IGNORECASE)
WEB_FOLDER = re.compile(r"^web-[a-z0-9.-]+$")  # no "/" and no "__": no hub repository's folder
HEX64 = re.compile(r"[0-9a-f]{64}")
MAX_REDIRECTS = 5
BLOB_PAGE = re.compile(r"^(?P<repo>/[^/]+/[^/]+)/blob/(?P<rest>[^/]+/.+)$")


def is_url(ref: str) -> bool:
    return bool(URL_REFERENCE.match(ref))


def is_url_entry(entry: ModelEntry) -> bool:
    return bool(WEB_FOLDER.match(entry.repo))


def entry_from_url(url: str) -> ModelEntry:
    """The store's entry for a GGUF file at an http(s) URL; BadReferenceError (or UnsafeNameError for a
    name that cannot be stored) before anything is asked of the server."""
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018  (a port that is no number raises here)
    except ValueError:
        raise BadReferenceError(f"{url!r}: the port is not a number") from None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname or any(c.isspace() for c in url):
        raise BadReferenceError(f"{url!r} is not a model URL: give http(s)://HOST/PATH/FILE.gguf")
    url, parts = _download_link(url, parts)
    name = unquote(parts.path.rsplit("/", 1)[-1])
    reason = "a '/' in the name (%2F)" if "/" in name else unsafe_file_reason(name)
    if reason:
        raise UnsafeNameError(f"{_shown(url)}: the file name {name!r} is refused ({reason}); nothing was written")
    if not name.lower().endswith(".gguf"):
        raise BadReferenceError(f"{_shown(url)}: its path ends in {name!r}, not a .gguf file name; give the URL "
                                f"of the GGUF file itself")
    entry = ModelEntry(url, _folder(parts), with_shards(_folder(parts), name), revision=_shown(url))
    _adopt_old_layout(entry, _host_folder(parts))
    return entry


def _download_link(url: str, parts):
    """The hub's download link for its web page of a file (/OWNER/REPO/blob/REV/FILE, what a browser's
    address bar shows, is HTML): /resolve/ in place of /blob/, said on stderr. Other URLs as they are."""
    m = BLOB_PAGE.match(parts.path)
    if not m or not at_hub(url):  # another server's /blob/ (GitHub's) has another download path
        return url, parts
    resolved = urlunsplit(parts._replace(path=f"{m['repo']}/resolve/{m['rest']}"))
    print(f"ggufspec: note: {_shown(url)} is the hub's web page of the file; downloading {_shown(resolved)}",
          file=sys.stderr)
    return resolved, urlsplit(resolved)


def _folder(parts) -> str:
    """web-HOST[-PORT]-HASH, HASH 8 hex digits of the URL's folder path: the same file name under two paths
    of a server (alice/.../ggml-model-Q4_K_M.gguf, bob/...) is two files of the store, a split's shards one folder."""
    # the scheme, host, port and folder as sent (not unquoted): http://x:80/m/ and http://x-80/m/, or /a%FF/ and
    # /a%FE/, share a readable folder name but not this
    where = f"{parts.scheme.lower()}://{(parts.hostname or '').lower()}:{parts.port}{parts.path.rsplit('/', 1)[0]}"
    digest = hashlib.sha256(where.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{_host_folder(parts)[:MAX_SEGMENT - 9]}-{digest}"


def _host_folder(parts) -> str:
    """web-HOST[-PORT]: the host lowercased, anything but letters, digits, dots and dashes a dash (the
    folder of every URL of a host before the path was part of it)."""
    host = re.sub(r"[^a-z0-9.-]", "-", parts.hostname.lower())
    return f"web-{host}{f'-{parts.port}' if parts.port is not None else ''}"[:MAX_SEGMENT]


def _adopt_old_layout(entry: ModelEntry, old_folder: str) -> None:
    """A file an older ggufspec stored under web-HOST[-PORT]/ moved to this URL's folder, where its note says
    it came from this very URL; another URL's file of that name stays (`list` shows it by its path)."""
    old = dataclasses.replace(entry, repo=old_folder)
    notes = verified_files(old)
    for file, note in notes.items():
        source, target = contained(models_dir(), old_folder, file), contained(models_dir(), entry.repo, file)
        if note.get("revision") != entry.revision or None in (source, target) or not source.is_file() \
                or target.exists():
            continue
        with contextlib.suppress(OSError):  # a store that cannot be written: the file is downloaded again
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(source, target)
            record_verified(entry, file, note["size"], note["sha256"])


def _shown(url: str) -> str:
    """The URL as errors, notes and `list` show it: no credentials, query (a signature) or fragment."""
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme.lower(), netloc, parts.path, "", ""))


def file_url(entry: ModelEntry, file: str) -> str:
    """Where one of a URL entry's files is: the URL given for its own file, its folder for a sibling shard."""
    parts = urlsplit(entry.name)
    if unquote(parts.path.rsplit("/", 1)[-1]) == file:
        return urlunsplit(parts._replace(fragment=""))
    path = parts.path.rsplit("/", 1)[0] + "/" + quote(file)
    return urlunsplit(parts._replace(path=path, query="", fragment=""))


def label_of(entry: ModelEntry, file: str) -> str:
    """How errors name a file of the store: OWNER/REPO/FILE, or the URL it came from."""
    return _shown(file_url(entry, file)) if is_url_entry(entry) else f"{entry.repo}/{file}"


def url_metadata(entry: ModelEntry, file: str) -> tuple[int | None, str | None, str, str]:
    """(size, sha256 or None, URL of the bytes, ETag) of a URL entry's file, from HEAD answers, redirects
    followed (huggingface_hub's HEAD follows relative ones only). Only the hub's X-Linked-Etag is taken
    for a sha256: another server's ETag may be anything."""
    from huggingface_hub import get_hf_file_metadata
    url = file_url(entry, file)
    with url_errors(url):
        for _ in range(MAX_REDIRECTS):
            meta = get_hf_file_metadata(url, token=None if at_hub(url) else False)
            if meta.size is not None or not meta.location or meta.location == url:
                break
            url = meta.location
    if meta.size is not None and not 0 < meta.size <= MAX_FILE_BYTES:
        raise StoreError(f"{label_of(entry, file)}: the server reports a size of {meta.size} bytes, which no GGUF "
                         f"file has; nothing was written")
    etag = (meta.etag or "").strip('"').lower()
    sha256 = etag if at_hub(url) and HEX64.fullmatch(etag) else None
    return meta.size, sha256, meta.location or url, etag


@contextlib.contextmanager
def url_errors(url: str):
    """A plain server's HTTP errors as one line naming the URL; an unreachable one (or offline mode) as
    the hub's are (HubUnreachable)."""
    from huggingface_hub import errors as hf_errors
    shown = _shown(url)
    with hub_errors(shown, where=origin(url), hub=at_hub(url)):
        try:
            yield
        except hf_errors.HfHubHTTPError as exc:
            status = getattr(getattr(exc, "response", None), "status_code", None)
            hint = {401: ": it asks for a login (ggufspec sends the Hugging Face token to the hub only)",
                    403: ": access refused", 404: ": no such file; check the URL"}.get(status, "")
            raise StoreError(f"{shown}: the server answered HTTP {status}{hint}") from None
