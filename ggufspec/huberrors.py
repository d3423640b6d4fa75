"""The hub's failures as one-line StoreErrors that say how to fix them, whichever HTTP stack
huggingface_hub uses: an unreachable hub, a gated or missing repository, a transfer cut midway
(which the next pull resumes). And where the hub is: HF_ENDPOINT, read per call; whether it may be
asked at all: huggingface_hub's offline mode (HF_HUB_OFFLINE, or the CLI's --offline)."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import socket

from .errors import StoreError


def _endpoint_env() -> str:
    return os.environ.get("HF_ENDPOINT", "").strip().rstrip("/")


def endpoint() -> str:
    """The hub's address. HF_ENDPOINT is read per call, not at import: huggingface_hub's own constant
    is frozen at import time (and an empty HF_ENDPOINT would leave it empty)."""
    from huggingface_hub import constants
    return _endpoint_env() or constants.ENDPOINT or "https://huggingface.co"


def offline_mode() -> bool:
    """huggingface_hub's offline mode: its requests fail at once (OfflineModeIsEnabled), nothing is fetched."""
    from huggingface_hub import constants
    return bool(getattr(constants, "HF_HUB_OFFLINE", False))


def go_offline() -> None:
    """Offline mode for this process (huggingface_hub reads its constant per request) and those it starts."""
    from huggingface_hub import constants
    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True


class HubUnreachable(StoreError):
    """No connection to the hub could be made (refused, DNS, offline mode): nothing was transferred."""


def hub_errors(label: str, *, transfer: bool = False, where: str | None = None, hub: bool = True,
               revision: str | None = None):
    """huggingface_hub's exceptions as one-line StoreErrors that say how to fix the problem.

    Outside a transfer (HEAD requests, listings) every transport error means the hub was not
    reached; during one, only a failure to connect does: anything else cut a transfer that had
    started, which the next pull resumes. `hub`: False for a plain URL's server (no HF_ENDPOINT to check).
    `revision`: the one asked for, named when the hub has no such revision."""
    from huggingface_hub import errors as hf_errors

    @contextlib.contextmanager
    def mapping():
        try:
            yield
        except hf_errors.OfflineModeIsEnabled:
            raise HubUnreachable(f"{label}: HF_HUB_OFFLINE is set, so the hub is not asked; unset it to pull") from None
        except hf_errors.GatedRepoError:
            raise StoreError(f"{label}: the repository is gated: accept its licence on the hub, then "
                             f"`hf auth login` or set HF_TOKEN") from None
        except hf_errors.RepositoryNotFoundError:
            private = ("the token given may not read it" if token_given() else "set HF_TOKEN")
            raise StoreError(f"{label}: repository not found (or private: {private})") from None
        except hf_errors.EntryNotFoundError:
            raise StoreError(f"{label}: file not found in the repository; check the name with the hub") from None
        except hf_errors.RevisionNotFoundError:
            raise StoreError(_no_revision(label, revision)) from None
        except hf_errors.HfHubHTTPError as exc:
            raise StoreError(_http_message(label, exc)) from None
        except OSError as exc:
            if exc.errno in (errno.EFBIG, errno.EROFS):  # the store's disk refuses the file: not a cut transfer
                raise StoreError(f"{label}: the download cannot be written ({_reason(exc)}): set GGUFSPEC_HOME to "
                                 f"a folder on a writable file system that takes files this large (FAT32 takes "
                                 f"none over 4 GiB), then run pull again") from None
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise_transport(exc)
                raise
            raise StoreError(f"{label}: the disk is full ({_reason(exc)}): free some space, or set GGUFSPEC_HOME "
                             f"to a folder on another disk, then run pull again to resume") from None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            if transfer:
                raise
            if isinstance(exc, json.JSONDecodeError):  # an HTML page answered with 200: a captive portal, a proxy
                raise StoreError(f"{label}: the hub at {where or endpoint()} answered with something no hub sends (a "
                                 f"page that is not JSON: a network's login page, a proxy?): check the network, or "
                                 f"HF_ENDPOINT") from None
            # an answer that is not what a hub sends (not JSON, or JSON of another shape): a mirror or a proxy's page
            raise StoreError(f"{label}: the hub at {where or endpoint()} answered with something no hub sends "
                             f"({type(exc).__name__}: {_reason(exc)}): check HF_ENDPOINT") from None
        except Exception as exc:
            raise_transport(exc)
            raise

    def raise_transport(exc: Exception) -> None:
        """A transport error as a StoreError; anything else is left to the caller to raise."""
        if not _is_transport_error(exc):
            return
        if any(type(e).__name__ == "TooManyRedirects" for e in _causes(exc)):  # reached, but it goes round in circles
            raise StoreError(f"{label}: {where or endpoint()} redirects in a loop ({_reason(exc)}): check "
                             f"{'HF_ENDPOINT' if hub else 'the URL'}, or try again later") from None
        if not transfer or _is_connect_error(exc):
            raise HubUnreachable(_unreachable_message(where or endpoint(), exc, hub)) from None
        raise StoreError(f"{label}: download interrupted ({type(exc).__name__}: {_reason(exc)}); "
                         f"run pull again to resume") from None
    return mapping()


def token_given() -> bool:
    """Whether huggingface_hub sends a token (HF_TOKEN, or `hf auth login`'s): a 401 then means it was refused."""
    from huggingface_hub import get_token
    return bool(get_token())


def _no_revision(label: str, revision: str | None) -> str:
    if revision in (None, "main"):
        return f"{label}: the repository has no revision 'main' (no main branch?): check the repository on the hub"
    # only a models.toml entry asks for a revision other than main
    return (f"{label}: revision {revision!r} not found in the repository: fix `revision` where models.toml defines "
            f"the model (a branch, tag or commit of the repository; `ggufspec list` names the models)")


def _http_message(label: str, exc: Exception) -> str:
    """The hub's HTTP error as one line: what the status means, and what to do about it."""
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    said = (getattr(response, "headers", None) or {}).get("X-Error-Message")
    said = f": {said.strip().rstrip('.')}" if said and said.strip() else ""
    if status == 401:
        hint = ("the token given (HF_TOKEN, or `hf auth login`'s) was refused: check it, or log in again"
                if token_given() else "set HF_TOKEN (or `hf auth login`) to a token that may read it")
        return f"{label}: the hub asks for a login (HTTP 401{said}): {hint}"
    if status == 403:
        hint = ("the token given may not read it: use one with read access to the repository" if token_given()
                else "set HF_TOKEN (or `hf auth login`) to a token that may read it")
        return f"{label}: the hub refused access (HTTP 403{said}): {hint}"
    if status == 429:
        wait = (getattr(response, "headers", None) or {}).get("Retry-After")
        return (f"{label}: the hub is rate-limiting requests (HTTP 429): run pull again later (in "
                f"{f'{wait} s' if wait else 'a few minutes'}; what was downloaded is kept)")
    if status is not None and status >= 500:
        return f"{label}: the hub is failing (HTTP {status}): run pull again later (what was downloaded is kept)"
    if status == 404:
        return f"{label}: not found at the hub (HTTP 404{said}): check the name, and HF_ENDPOINT if it is set"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"{label}: hub error: {first}" if status is None else f"{label}: the hub answered HTTP {status}{said}"


def _is_transport_error(exc: Exception) -> bool:
    """A dropped connection or timeout, whichever HTTP stack this huggingface_hub version uses."""
    from huggingface_hub import errors as hf_errors
    module = type(exc).__module__.split(".")[0]
    return (isinstance(exc, (OSError, hf_errors.LocalEntryNotFoundError))
            or module.startswith(("httpx", "httpcore", "requests", "urllib3", "h11")))


def _unreachable_message(where: str, exc: Exception, hub: bool = True) -> str:
    if not hub:
        return f"cannot reach {where} ({_reason(exc)}): check the URL and the network"
    hint = (f"check HF_ENDPOINT (set to {_endpoint_env()}) and the network" if _endpoint_env()
            else "check the network (HF_ENDPOINT points ggufspec at another hub or a mirror)")
    return f"cannot reach the hub at {where} ({_reason(exc)}): {hint}"


HUB_HOSTS = ("https://huggingface.co", "https://hf.co")


def download_headers(url: str) -> dict:
    """huggingface_hub's headers for getting a file's bytes from `url`, without the user's token where
    the hub redirected to another host (a CDN's signed URL needs none), as `hf_hub_download` does."""
    from huggingface_hub.utils import build_hf_headers
    headers = build_hf_headers()
    if not at_hub(url):
        headers.pop("authorization", None)
    return headers


def at_hub(url: str) -> bool:
    """Whether `url` is the hub's (HF_ENDPOINT's or huggingface.co's): the only place the token goes."""
    return origin(url) in (origin(endpoint()), *HUB_HOSTS)


def origin(url: str) -> str:
    """scheme://host[:port] of a URL: where a transfer connects (the hub, or the CDN it redirects to)."""
    from urllib.parse import urlsplit
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}" if parts.netloc else url


CONNECT_ERRORS = {"ConnectError", "ConnectTimeout", "NewConnectionError", "NameResolutionError"}


def _causes(exc: BaseException):
    seen = set()
    # isinstance: a JSONDecodeError's __context__ is a number (json.decoder's StopIteration value)
    while isinstance(exc, BaseException) and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _is_connect_error(exc: Exception) -> bool:
    """No connection was made at all: refused, unresolvable name, unreachable network, connect timeout."""
    return any(isinstance(e, (ConnectionRefusedError, socket.gaierror)) or type(e).__name__ in CONNECT_ERRORS
               or (isinstance(e, OSError) and e.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH))
               for e in _causes(exc))


def _reason(exc: Exception) -> str:
    """The innermost cause's message, on one line: 'Connection refused' rather than a wrapper's prose."""
    for e in reversed(list(_causes(exc))):
        text = (e.strerror if isinstance(e, OSError) and e.strerror else str(e)).strip()
        if text:
            return text.splitlines()[0]
    return type(exc).__name__
