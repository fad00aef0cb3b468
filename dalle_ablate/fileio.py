"""Writing files so that a crash or a concurrent writer never leaves a torn one, on a local disk
and in a bucket (`gs://`).

A folder in a bucket is worked on through a local staging copy of it: `gs://<bucket>/<path>` is
`<staging root>/gs/<bucket>/<path>` (`staged`), the staging root being `$DALLE_ABLATE_STAGING` or
`~/.cache/dalle-ablate/staging`. Every file this package writes under a staged folder
(`atomic_write`, `atomic_savez`, `push`) is then uploaded whole, as one object PUT: Cloud Storage
makes an object visible only once its upload is complete, so a reader -- a resume on another host
-- sees the old object or the new one, never half of one. Reading a bucket folder (`pull`) copies
it, less its checkpoints (which orbax and TensorStore read and write in the bucket themselves),
into its staging folder. The transfers go through fsspec (gcsfs); the bucket check and the
store's lock use google-cloud-storage for what fsspec does not offer: a call without retries (a
missing or unreachable bucket is one line within seconds) and generation-match preconditions.
Credentials are the platform's (Application Default Credentials); none is ever logged.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from dalle_ablate import interrupts
from dalle_ablate.registry import ConfigError, RunFailed

SCHEME = "gs://"
NOT_PULLED = (
    "checkpoints",
    "wandb",
)  # left in the bucket by `pull`: orbax reads checkpoints there; W&B's folder stays local
LOCK = ".writer.lock"  # a run store's single-writer lock (a flock'ed file locally, a leased object in a bucket)
_checked: set[str] = set()  # buckets found reachable by this process
_pulled: dict[str, Path] = {}  # local_dir's folders, pulled by this process


def is_url(path) -> bool:
    """Whether `path` names an object store (`scheme://...`) rather than a local file."""
    return "://" in str(path)


def looks_like_url(path) -> bool:
    """Whether `path` begins as a URL does (`scheme:`): a `gs://` URL, and also what a user meant as
    one and mistyped (`gs:/bucket/x`, `gs:bucket`, `s3:/x`) -- never a local folder to create."""
    return is_url(path) or bool(re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", str(path)))


def check_url(url: str, field: str, given: Optional[str] = None) -> str:
    """`url` if it is a `gs://bucket/...` URL, else a ConfigError naming `field` (`given`: how
    the user gave it, when not as `field=`)."""
    if not re.fullmatch(r"gs://[a-z0-9][a-z0-9._-]{1,221}[a-z0-9](/.*)?", url):
        raise ConfigError(
            f"{given or field + '='}{url}: not a bucket URL this tool can use; give gs://<bucket>/<path> (Cloud Storage; "
            f"s3:// and other stores are not supported, docs/guides/runs.md says why)"
        )
    return url.rstrip("/")


def split(url: str) -> tuple[str, str]:
    """(bucket, path inside it) of a gs:// URL."""
    bucket, _, key = url[len(SCHEME) :].partition("/")
    return bucket, key.strip("/")


def staging_root() -> Path:
    return Path(os.environ.get("DALLE_ABLATE_STAGING") or "~/.cache/dalle-ablate/staging").expanduser().absolute()


def staged(url: str) -> Path:
    """The local staging folder of a bucket URL."""
    bucket, key = split(url)
    return staging_root() / "gs" / bucket / key


def url_of(path) -> Optional[str]:
    """The bucket URL a local path stands for (it is under the staging root), else None."""
    if is_url(path):
        return str(path).rstrip("/")
    try:
        rel = Path(os.path.abspath(path)).relative_to(staging_root() / "gs")
    except ValueError:
        return None
    return SCHEME + rel.as_posix() if rel.parts else None


def shown(path) -> str:
    """A path as a user gives it: the bucket URL of a staged folder, else the path."""
    return url_of(path) or str(path)


def filesystem(url: str):
    """The fsspec filesystem of `url`'s bucket, checked reachable (once per process)."""
    import fsspec

    check_bucket(url)
    return fsspec.filesystem("gs")


def _client():
    from google.cloud import storage

    return storage.Client()  # Application Default Credentials; the emulator's when STORAGE_EMULATOR_HOST is set


def check_bucket(url: str) -> None:
    """One line within seconds for a bucket that does not exist, is not ours or cannot be reached
    (one request, no retries), instead of a client's minute of retries and tracebacks."""
    bucket, _ = split(url)
    if bucket in _checked:
        return
    from google.api_core import exceptions as gx
    from google.auth import exceptions as auth

    where = f"{SCHEME}{bucket}"
    try:
        _client().get_bucket(bucket, timeout=10, retry=None)
    except gx.NotFound:
        raise RunFailed(
            f"{where}: no such bucket; create it (gcloud storage buckets create {where}) or fix the URL"
        ) from None
    except gx.Forbidden:
        raise RunFailed(f"{where}: no access with this machine's Application Default Credentials") from None
    except auth.DefaultCredentialsError:
        raise RunFailed(
            f"{where}: no Application Default Credentials on this machine (gcloud auth application-default "
            f"login, or a VM's service account)"
        ) from None
    except Exception as e:  # noqa: BLE001 - connection errors come in several types (requests, urllib3, google.auth)
        raise RunFailed(f"{where}: cannot be reached ({type(e).__name__})") from None
    _checked.add(bucket)


# Buckets this process could not write to, and why: after the client's own retries (about half a
# minute per upload) the run is ending, and what it still writes on its way out (its summary, the
# rest of its log) goes to the staging copy at once instead of waiting out the same retries again.
# A new run store tries its bucket again (retry_bucket): a multirun's next job is not the one that failed.
_DOWN: dict[str, str] = {}


def retry_bucket(path) -> None:
    """Let uploads under `path` (a staged folder or a URL) try their bucket again."""
    url = path if is_url(str(path)) else url_of(path)
    if url is not None:
        _DOWN.pop(split(url)[0], None)


def push(path) -> None:
    """Upload a file written under a staged folder to its object, whole, in one PUT. A bucket an
    upload of this process failed to reach is not tried again: a one-line RunFailed at once."""
    url = url_of(path)
    if url is not None and not is_url(path):
        bucket = split(url)[0]
        if bucket in _DOWN:
            raise RunFailed(
                f"{url} cannot be written ({_DOWN[bucket]}, an upload before it); its staging copy {path} is whole: "
                "fix the bucket, then resume=auto"
            )
        from fsspec.exceptions import FSTimeoutError

        fs = filesystem(url)
        end = interrupts.stop_deadline()  # after a SIGTERM: no longer than its grace period allows
        try:
            fs.put_file(str(path), url, **({} if end is None else {"timeout": max(end - time.monotonic(), 0.1)}))
        except Exception as e:  # noqa: BLE001 - after gcsfs's own retries: HttpError, aiohttp's and OS errors
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            _DOWN[bucket] = (
                f"no answer within the {interrupts.grace_s():.0f} s grace period after SIGTERM"
                if isinstance(e, FSTimeoutError)
                else f"{type(e).__name__}{': ' + first if first else ''}"
            )
            raise RunFailed(
                f"{url} cannot be written ({_DOWN[bucket]}); its staging copy {path} is whole: fix the bucket, then "
                "resume=auto"
            ) from e


def fetch(url: str, local: Path) -> bool:
    """Download one object to `local` (whether it exists)."""
    fs = filesystem(url)
    fs.invalidate_cache()
    if not fs.exists(url):
        return False
    Path(local).parent.mkdir(parents=True, exist_ok=True)
    fs.get_file(url, str(local))
    return True


def push_tree(folder) -> None:
    """Upload every file under a staged folder (e.g. a sample table's images)."""
    for p in sorted(Path(folder).rglob("*")):
        if p.is_file():
            push(p)


def held_by_another(folder: Path) -> bool:
    """Whether another process of this host holds the writer's lock of `folder` (its flock on
    `<folder>/.writer.lock`: a run store being written from this staging root). A lock this
    process holds counts too (flock is per open file), so a process asks only of folders it has
    not locked itself."""
    import fcntl

    try:
        with open(Path(folder) / LOCK, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released as the file closes
    except BlockingIOError:
        return True
    except OSError:  # no such folder, or one this process cannot open a file in: no writer's lock there
        return False
    return False


def pull(url: str, keep: tuple[str, ...] = ()) -> Path:
    """Make the staging folder of `url` a copy of the bucket folder, less `NOT_PULLED` (the names
    in `keep`, at its top, are left as they are locally), and return it. A folder the bucket does
    not have yet is an empty staging folder. Writers' lock files are never removed, and a folder
    below the top whose writer is a live process of this host (a run store it writes, locked) is
    left as it is: its staging copy is that writer's, newer than the bucket's."""
    local = staged(url)
    fs = filesystem(url)
    live = (
        {
            f.parent.relative_to(local).parts
            for f in local.rglob(LOCK)
            if f.parent != local and held_by_another(f.parent)
        }
        if local.is_dir()
        else set()
    )

    def written_here(parts: tuple[str, ...]) -> bool:
        return any(parts[: len(w)] == w for w in live)

    for p in sorted(local.rglob("*"), reverse=True) if local.is_dir() else []:  # a folder's files before it
        parts = p.relative_to(local).parts
        if parts[0] in keep or set(parts) & set(NOT_PULLED) or p.name == LOCK or written_here(parts):
            continue  # e.g. W&B's offline folders of this host's earlier processes: never in the bucket, kept
        if p.is_dir() and not p.is_symlink():
            if not any(p.iterdir()):
                p.rmdir()
        else:
            p.unlink()
    local.mkdir(parents=True, exist_ok=True)
    fs.invalidate_cache()  # another process (a run, another host) wrote there since this one last looked
    prefix = url[len(SCHEME) :].rstrip("/") + "/"
    rel = [f[len(prefix) :] for f in fs.find(url) if f.startswith(prefix)]
    wanted = [
        r
        for r in rel
        if not set(r.split("/")[:-1]) & set(NOT_PULLED)
        and r.split("/")[0] not in keep
        and r.rsplit("/", 1)[-1] != LOCK
        and not written_here(tuple(r.split("/")))
    ]
    if wanted:
        fs.get([SCHEME + prefix + r for r in wanted], [str(local / r) for r in wanted])
    return local


def local_dir(url: str, field: str) -> Path:
    """The staging folder of a bucket folder a process reads and adds to (a cache: `data.cache_dir`),
    made the bucket's copy the first time this process asks for it."""
    url = check_url(url, field)
    if url not in _pulled:
        _pulled[url] = pull(url)
    return _pulled[url]


def local_source(source: str, field: str) -> str:
    """What a reader is given (a folder or a glob of run stores), local: a bucket URL is pulled
    (its folder above the first wildcard) and its staging path, with the same wildcards, returned."""
    if not is_url(source):
        return source
    check_url(source.split("*")[0].split("?")[0].split("[")[0].rstrip("/") or source, field)
    parts = source.split("/")
    fixed = next((i for i, p in enumerate(parts) if any(c in p for c in "*?[")), len(parts))
    root = "/".join(parts[:fixed]).rstrip("/")
    local = pull(root)
    return str(local / "/".join(parts[fixed:])) if fixed < len(parts) else str(local)


def open_url(url: str, mode: str = "rb"):
    """A file object on an object (fsspec's, readahead cached)."""
    return filesystem(url).open(url, mode)


def glob_urls(pattern: str) -> list[str]:
    """The objects a gs:// glob (or one object's URL) matches, as URLs, sorted."""
    fs = filesystem(pattern)
    fs.invalidate_cache()
    return sorted(SCHEME + f for f in fs.glob(pattern) if fs.isfile(SCHEME + f))


def atomic_savez(path: Path, **arrays) -> None:
    """np.savez to a temporary name, then rename over the target: a failure never leaves a torn
    .npz where a good one was (in a bucket: the whole file, one PUT)."""
    import numpy as np

    path = Path(path)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npz")
    try:
        np.savez(tmp, **arrays)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    push(path)


def atomic_write(path: Path, text: str) -> None:
    """Write to a temporary name of this process, then rename over the target (atomic on POSIX);
    under a staged folder, then upload it whole (one PUT: atomic in Cloud Storage)."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    push(path)


class BucketLock:
    """One writer per run store in a bucket, which has no flock: an object `<store>/.writer.lock`
    created only if absent (a generation-match precondition, `ifGenerationMatch=0`: of two writers,
    Cloud Storage lets exactly one create it), naming its holder and renewed as a lease while it
    writes (`renew`, each replacing the generation it wrote). A lock whose lease ran out, or whose
    holder is a process of this host that is gone (kill -9), is taken over -- again on the
    generation read, so two resumes cannot both take it; any other is a one-line refusal."""

    LEASE_S = 120.0  # a preempted VM's lock is stale this long after its last renewal

    def __init__(self, url: str, holder: str, lease_s: Optional[float] = None, what: str = "run store"):
        from google.api_core import exceptions as gx

        check_bucket(url)
        bucket, key = split(url)
        self.url, self.holder, self.lease_s, self.what = url, holder, lease_s or self.LEASE_S, what
        self.blob = _client().bucket(bucket).blob(f"{key}/{LOCK}" if key else LOCK)
        self.generation: Optional[int] = None
        self._mutex = threading.Lock()  # the lease's renewal (a thread of the writer) and the release, one at a time
        try:
            self._write(0)
        except gx.PreconditionFailed:
            self._take_over()
        except (gx.Forbidden, gx.Unauthorized) as e:  # a bucket that refuses this account's writes: one line
            first = (str(e).strip().splitlines() or [""])[0]
            raise RunFailed(
                f"{self.what} {url} cannot be written: the bucket refuses this account's writes "
                f"({type(e).__name__}: {first}); give a bucket it can write to, or grant it write access"
            ) from None

    def _write(self, generation: int) -> None:
        import json
        import socket

        body = json.dumps(
            {
                "holder": self.holder,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "expires": time.time() + self.lease_s,
            }
        )
        self.blob.upload_from_string(body, if_generation_match=generation, retry=None, timeout=30)
        self.generation = self.blob.generation

    def _take_over(self) -> None:
        import json

        from google.api_core import exceptions as gx

        try:
            self.blob.reload(retry=None, timeout=30)
            held = json.loads(
                self.blob.download_as_bytes(if_generation_match=self.blob.generation, retry=None, timeout=30)
            )
            if not stale(held):
                until = time.strftime("%H:%M:%S", time.localtime(held["expires"]))
                raise RunFailed(
                    f"{self.what} {self.url} is being written by another process ({held['holder']}; its lease "
                    f"runs to {until}); wait for it to end or stop it, then run again (one writer per run store)"
                )
            self._write(self.blob.generation)
            why = "its lease ran out" if time.time() > float(held.get("expires", 0)) else "its process is gone"
            print(
                f"warning: {self.what} {self.url}: took its lock over from {held.get('holder')} "
                f"(host {held.get('host')}, pid {held.get('pid')}): {why}",
                file=sys.stderr,
                flush=True,
            )
        except (gx.PreconditionFailed, gx.NotFound):
            raise RunFailed(
                f"{self.what} {self.url}: another process took its lock at the same moment; run again to see "
                f"who holds it (one writer per run store)"
            ) from None

    def renew(self) -> None:
        """Extend the lease (the writer calls it more often than `lease_s`); a lock taken over
        meanwhile raises RunFailed, a bucket that does not answer the client's error."""
        from google.api_core import exceptions as gx

        try:
            with self._mutex:
                if self.generation is not None:  # not released meanwhile
                    self._write(self.generation)
        except gx.PreconditionFailed:
            raise RunFailed(
                f"{self.what} {self.url}: its lock was taken over by another process while this one wrote "
                f"(its lease of {self.lease_s:.0f} s ran out)"
            ) from None

    def release(self) -> None:
        with self._mutex:
            self._release()

    def _release(self) -> None:
        from google.api_core import exceptions as gx

        if self.generation is not None:
            try:
                # Read first: the precondition alone is what Cloud Storage honours, but fake-gcs-server
                # (the suite's emulator) deletes whatever generation a DELETE names.
                self.blob.reload(retry=None, timeout=30)
                if self.blob.generation == self.generation:
                    self.blob.delete(if_generation_match=self.generation, retry=None, timeout=30)
            except (gx.PreconditionFailed, gx.NotFound):
                pass  # taken over: it is the new holder's now
            self.generation = None


def stale(held: dict) -> bool:
    """Whether a bucket lock's holder is gone: its lease ran out, or it is a process of this host
    that no longer exists."""
    import socket

    if time.time() > float(held.get("expires", 0)):
        return True
    if held.get("host") == socket.gethostname():
        try:
            os.kill(int(held["pid"]), 0)
        except ProcessLookupError:
            return True
        except (PermissionError, KeyError, ValueError):
            return False
    return False
