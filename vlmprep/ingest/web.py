"""An http(s) input or image, read with every wait bounded and every answer checked: connecting, each response's
headers and each read of its body wait at most VLMPREP_HTTP_TIMEOUT seconds (30), then fail in one line naming the
URL; redirects are followed to http(s) only; every response of an object is checked against the stamp it had when
first seen (ETag, size, Last-Modified), so an object replaced while it is read is refused, never mixed; a body sent
with no length (chunked, gzip-encoded) is read as one stream; each failure kind has one wording. No URL printed here
carries a credential.
"""

from __future__ import annotations

import email.utils
import fnmatch
import html
import io
import os
import posixpath
import re
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib
from dataclasses import dataclass

from vlmprep_schemas.boundary import redact_credentials

TIMEOUT_ENV = "VLMPREP_HTTP_TIMEOUT"
MAX_REDIRECTS = 5
MAX_LISTED = 100_000  # links a listing of a prefix may yield, all pages together
MAX_PAGE = 64 << 20  # bytes of one index page
_HREF = re.compile(r"""href\s*=\s*["']([^"'#]+)["']""", re.I)


class WebError(OSError):
    """An http(s) read that failed: one line naming the URL (never a credential) and what happened; `status`: the
    HTTP status that said so, where one did."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class TooLarge(WebError):
    """A body longer than the most its reader takes."""


def timeout() -> float:
    """Seconds any one wait on a server may take (VLMPREP_HTTP_TIMEOUT; 30)."""
    try:
        t = float(os.environ.get(TIMEOUT_ENV) or 30)
    except ValueError:
        return 30.0
    return t if t > 0 else 30.0


def show(url: str) -> str:
    """A URL as any message here prints it: credentials redacted, at most 200 characters."""
    return redact_credentials(url)[:200]


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Redirects to http(s) only (a Location of file://, ftp:// or data: is refused, naming both), at most
    MAX_REDIRECTS, a HEAD staying a HEAD."""

    max_redirections = MAX_REDIRECTS

    def http_error_302(self, req, fp, code, msg, headers):
        """Refuse a redirect to anything but http(s) before urllib looks at it."""
        target = urllib.parse.urljoin(req.full_url, headers.get("Location") or headers.get("URI") or "")
        if urllib.parse.urlsplit(target).scheme.lower() not in ("http", "https"):
            fp.close()
            raise WebError(
                f"cannot read {show(req.full_url)}: redirect ({code}) to {show(target)} refused "
                "(only http(s) redirects are followed)",
                code,
            )
        return super().http_error_302(req, fp, code, msg, headers)

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        """urllib's new request, with the method kept (a HEAD is not turned into a GET of the whole body)."""
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None:
            new.method = req.get_method()
        return new


def _opener() -> urllib.request.OpenerDirector:
    """urllib without its file://, ftp:// and data: handlers, and with the redirect rule above."""
    opener = urllib.request.OpenerDirector()
    for h in (
        urllib.request.ProxyHandler(),
        urllib.request.UnknownHandler(),
        urllib.request.HTTPHandler(),
        urllib.request.HTTPSHandler(),
        urllib.request.HTTPDefaultErrorHandler(),
        _Redirects(),
        urllib.request.HTTPErrorProcessor(),
    ):
        opener.add_handler(h)
    return opener


def failure(url: str, e: BaseException) -> WebError:
    """Any fault of a request as the one line for its kind: not found (404), access denied (403), a redirect
    refused or looping, no answer within the bound, no connection, any other status."""
    if isinstance(e, WebError):
        return e
    status = None
    if isinstance(e, urllib.error.HTTPError):
        status = e.code
        e.close()
        what = (
            f"not found ({status})"
            if status in (404, 410)
            else f"access denied ({status})"
            if status in (401, 403)
            else f"too many redirects ({status})"
            if 300 <= status < 400
            else f"the server answered HTTP {status} {str(e.reason)[:80]}"
        )
    elif isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError):
        what = f"no answer for {timeout():g} s ({TIMEOUT_ENV} sets the bound)"
    elif isinstance(e, urllib.error.URLError):
        what = f"cannot connect: {str(e.reason)[:200]}"
    else:
        what = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    return WebError(f"cannot read {show(url)}: {redact_credentials(what)}", status)


def _refuse_credentials(url: str) -> None:
    if "@" in urllib.parse.urlsplit(url).netloc:
        raise WebError(
            f"cannot read {show(url)}: a URL with credentials in it (user:password@) is refused; "
            "give them to the server another way (a token in the environment, ~/.netrc)"
        )


def request(url: str, *, method: str = "GET", headers: dict | None = None):
    """The response to one request (its headers read within the timeout), or a WebError of its kind."""
    _refuse_credentials(url)
    req = urllib.request.Request(url, method=method, headers={"Accept-Encoding": "identity", **(headers or {})})
    try:
        return _opener().open(req, timeout=timeout())
    except Exception as e:  # noqa: BLE001 - http.client, ssl and socket each raise their own kinds
        raise failure(url, e) from None


@dataclass(frozen=True)
class Stamp:
    """What says an object is unchanged, as a response states it: its size (None where the server gives none: a
    chunked or encoded body), ETag (None where not sent), Last-Modified in ns (0 where not sent), and whether it
    serves ranges."""

    size: int | None
    etag: str | None
    mtime_ns: int = 0
    ranges: bool = True

    @classmethod
    def of(cls, r) -> Stamp:
        """The stamp a response's headers state (a 206's size from its Content-Range)."""
        h = r.headers
        size = None
        if r.status == 206:
            total = (h.get("Content-Range") or "").rsplit("/", 1)[-1]
            size = int(total) if total.isdigit() else None
        elif h.get("Content-Length", "").isdigit() and h.get("Content-Encoding", "identity") in ("identity", ""):
            size = int(h["Content-Length"])
        try:
            mtime_ns = int(email.utils.parsedate_to_datetime(h["Last-Modified"]).timestamp() * 1e9)
        except (KeyError, TypeError, ValueError):
            mtime_ns = 0
        ranges = (h.get("Accept-Ranges") or "").strip().lower() != "none"
        return cls(size, h.get("ETag") or None, mtime_ns, ranges)

    @classmethod
    def planned(cls, stamp: dict) -> Stamp:
        """A plan's stamp (as_dict) back."""
        return cls(stamp.get("bytes") or None, stamp.get("etag"), stamp.get("mtime_ns") or 0)

    def as_dict(self) -> dict:
        """The stamp in the plan's terms: bytes (0: unknown), mtime_ns (0: none), etag."""
        return {"bytes": self.size or 0, "mtime_ns": self.mtime_ns, "etag": self.etag}

    def changed(self, now: Stamp, when: str = "first read") -> str | None:
        """What differs in `now` (a later response's stamp) from this one, naming both; None where it matches. What
        a response does not state is not compared."""
        for what, a, b in (
            ("size", self.size, now.size),
            ("ETag", self.etag, now.etag),
            ("Last-Modified", self.mtime_ns or None, now.mtime_ns or None),
        ):
            if a is not None and b is not None and a != b:
                if what == "Last-Modified":
                    a, b = (email.utils.formatdate(t / 1e9, usegmt=True) for t in (a, b))
                return f"{what} {a} when {when}, {b} now"
        return None


def head(url: str) -> Stamp:
    """An object's stamp, from a HEAD (or, where HEAD is not allowed, a GET of its first byte)."""
    try:
        r = request(url, method="HEAD")
    except WebError as e:
        if e.status not in (405, 501):
            raise
        r = request(url, headers={"Range": "bytes=0-0"})
    with r:
        return Stamp.of(r)


class WebFile(io.RawIOBase):
    """An http(s) object as a seekable raw file. Where the server gives its size it is read by range requests of
    `block` bytes, each sent with If-Match its ETag and checked against its stamp; where it gives none (chunked, or
    gzip-encoded) it is one streamed GET, decoded as it is read, a seek ahead read through and a seek back read
    again from the start. `expect`: the plan's stamp of it (bytes, mtime_ns, etag), checked before the first byte."""

    def __init__(self, url: str, *, block: int, expect: dict | None = None):
        self.url, self._block = url, block
        self.stamp = head(url)
        why = Stamp.planned(expect).changed(self.stamp, "planned") if expect else None
        if why:
            raise WebError(f"cannot read {show(url)}: it changed after the plan was made ({why})")
        self._pos = 0
        self._buf, self._buf_at = b"", 0
        self._stream = None  # (response, decoder, position of its next byte) in stream mode

    def readable(self) -> bool:
        """Always."""
        return True

    def seekable(self) -> bool:
        """Always: a streamed object seeks by reading (ahead: through; back: again from the start)."""
        return True

    def tell(self) -> int:
        """The position of the next byte read."""
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        """Move the position (nothing is read yet); the end of an object sent with no length is unknown."""
        if whence == 2:
            if self.stamp.size is None:
                raise WebError(
                    f"cannot read {show(self.url)}: the server sends it with no length (chunked or encoded), so it "
                    "can only be read start to end; a Parquet or Arrow input needs its size: download it first"
                )
            offset += self.stamp.size
        elif whence == 1:
            offset += self._pos
        if offset < 0:
            raise ValueError(f"negative seek position {offset}")
        self._pos = offset
        return offset

    def readinto(self, b) -> int:
        """Bytes from the position on, from the block held or the next one fetched."""
        if self.stamp.size is not None and self._pos >= self.stamp.size:
            return 0
        if not (self._buf_at <= self._pos < self._buf_at + len(self._buf)):
            self._buf, self._buf_at = self._fill(), self._pos
        data = self._buf[self._pos - self._buf_at :][: len(b)]
        b[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def _fill(self) -> bytes:
        if self.stamp.size is not None and self.stamp.ranges and self._stream is None:
            return self._range()
        return self._streamed()

    def _check(self, r) -> None:
        why = self.stamp.changed(Stamp.of(r))
        if why:
            r.close()
            raise WebError(f"cannot read {show(self.url)}: it changed while it was read ({why}); read it again")

    def _range(self) -> bytes:
        """The block at the position, by one range request checked against the stamp."""
        a = self._pos
        z = min(a + self._block, self.stamp.size) - 1
        headers = {"Range": f"bytes={a}-{z}"}
        if self.stamp.etag and not self.stamp.etag.startswith("W/"):
            headers["If-Match"] = self.stamp.etag  # the server refuses (412) a replaced object itself
        try:
            r = request(self.url, headers=headers)
        except WebError as e:
            if e.status == 412:
                raise WebError(
                    f"cannot read {show(self.url)}: it changed while it was read (ETag {self.stamp.etag} when first "
                    "read; the server says it no longer matches); read it again"
                ) from None
            if e.status == 416:
                return b""
            raise
        if r.status != 206:  # Range ignored: the whole body; read it as a stream from here on
            self._check(r)
            self._stream = (r, _decoder(r, self.url), 0)
            return self._streamed()
        with r:
            self._check(r)
            got = (r.headers.get("Content-Range") or "").split(" ", 1)[-1].split("/", 1)[0]
            if got != f"{a}-{z}":
                raise WebError(f"cannot read {show(self.url)}: asked for bytes {a}-{z}, the server sent {got[:40]}")
            try:
                data = r.read(z - a + 2)
            except Exception as e:  # noqa: BLE001
                raise failure(self.url, e) from None
        if len(data) != z - a + 1:
            raise WebError(f"cannot read {show(self.url)}: asked for {z - a + 1} bytes at {a}, got {len(data)}")
        return data

    def _streamed(self) -> bytes:
        """The next bytes of the one streamed GET from the position on: opened (again, from the start) where it is
        not open or is past the position, read through to the position."""
        if self._stream is None or self._stream[2] > self._pos:
            self._close_stream()
            r = request(self.url)
            self._check(r)
            self._stream = (r, _decoder(r, self.url), 0)
        r, decode, at = self._stream
        while True:
            data = decode(self._block)
            if at + len(data) > self._pos or not data:
                break
            at += len(data)
        self._stream = (r, decode, at + len(data))
        return data[self._pos - at :] if data else b""

    def _close_stream(self) -> None:
        if self._stream is not None:
            self._stream[0].close()
            self._stream = None

    def close(self) -> None:
        """Closes the open response, if any."""
        self._close_stream()
        super().close()


def _decoder(r, url: str, *, short: bool = False):
    """`n -> up to n decoded bytes` of a response (b"" at its end): identity, gzip or deflate content encoding,
    decompressed as it is read (each call's output bounded by `n`); any other encoding is refused. `short`: return
    what one read of the socket gives rather than wait for n bytes (a caller that keeps a deadline)."""
    enc = (r.headers.get("Content-Encoding") or "identity").strip().lower()
    if enc not in ("identity", "", "gzip", "x-gzip", "deflate"):
        r.close()
        raise WebError(f"cannot read {show(url)}: Content-Encoding {enc[:40]} is not supported (gzip or none)")

    def read(n: int) -> bytes:
        try:
            return r.read1(n) if short else r.read(n)
        except Exception as e:  # noqa: BLE001 - a timeout, a reset, a chunk that does not parse
            raise failure(url, e) from None

    if enc in ("identity", ""):
        return read
    z = zlib.decompressobj(zlib.MAX_WBITS | 32 if enc != "deflate" else zlib.MAX_WBITS)
    pending = [b""]

    def decode(n: int) -> bytes:
        while not z.eof:
            src = pending[0] or read(n)
            if not src:
                return b""
            try:
                out = z.decompress(src, n)
            except zlib.error as e:
                raise WebError(f"cannot read {show(url)}: its {enc} body does not decode ({e})") from None
            pending[0] = z.unconsumed_tail
            if out:
                return out
        return b""

    return decode


def _read_all(r, url: str, limit: int, deadline: float) -> bytes:
    """A response's whole decoded body of at most `limit` bytes, by `deadline` (time.monotonic)."""
    decode, chunks, got = _decoder(r, url, short=True), [], 0
    while got <= limit:
        data = decode(min(1 << 20, limit + 1 - got))
        if not data:
            return b"".join(chunks)
        chunks.append(data)
        got += len(data)
        if time.monotonic() > deadline:
            raise WebError(f"cannot read {show(url)}: not sent whole in {4 * timeout():g} s ({TIMEOUT_ENV})")
    raise TooLarge(f"cannot read {show(url)}: more than {limit} bytes")


def fetch(url: str, limit: int) -> bytes:
    """A whole object of at most `limit` bytes (an image), within 4 timeouts in all: a server dripping bytes ends
    too."""
    deadline = time.monotonic() + 4 * timeout()
    with request(url) as r:
        return _read_all(r, url, limit, deadline)


def _inside(url: str, prefix: str) -> str | None:
    """A link's URL with its path normalized, where it is under `prefix` on the same server; None otherwise."""
    parts = urllib.parse.urlsplit(url)
    base = urllib.parse.urlsplit(prefix)
    if (parts.scheme.lower(), parts.netloc.lower()) != (base.scheme.lower(), base.netloc.lower()) or parts.query:
        return None
    path = posixpath.normpath(urllib.parse.unquote(parts.path)) + ("/" if parts.path.endswith("/") else "")
    if not path.startswith(urllib.parse.unquote(base.path)) or path == urllib.parse.unquote(base.path):
        return None
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, urllib.parse.quote(path), "", ""))


def listing(prefix: str, match) -> list[str]:
    """The object URLs a server's index pages list under `prefix` (a URL ending in /), recursively through links
    ending in /, for which `match(url)` holds. A link that leaves the prefix (`../`, another server, an absolute
    path elsewhere) is never followed nor listed."""
    found, pages, seen = set(), [prefix], {prefix}
    while pages:
        page = pages.pop()
        with request(page) as r:
            kind = (r.headers.get("Content-Type") or "").split(";")[0].strip().lower()
            if kind not in ("text/html", ""):
                raise WebError(f"cannot list {show(page)}: not an index page (Content-Type {kind[:40]})")
            body = _read_all(r, page, MAX_PAGE, time.monotonic() + 4 * timeout()).decode("utf-8", "replace")
        for href in _HREF.findall(body):
            url = _inside(urllib.parse.urljoin(page, html.unescape(href)), prefix)
            if url is None or url in seen:
                continue
            seen.add(url)
            if len(seen) > MAX_LISTED:
                raise WebError(f"cannot list {show(prefix)}: more than {MAX_LISTED} links")
            if url.endswith("/"):
                pages.append(url)
            elif match(url):
                found.add(url)
    return sorted(found)


def glob(pattern: str) -> list[str]:
    """The objects a glob URL names (`*` within a path part, `**` across parts), from the listing of its dir."""
    magic = min(i for i in (pattern.find(c) for c in "*[") if i >= 0)  # "?" starts a URL's query, not a glob
    prefix = pattern[: pattern.rfind("/", 0, magic) + 1]
    rx = re.compile(
        fnmatch.translate(pattern).replace(".*", "[^/]*").replace("[^/]*[^/]*", ".*")  # * in a part; ** across
    )
    return listing(prefix, lambda url: bool(rx.match(urllib.parse.unquote(url))))
