//! The bytes of an exchange with the upstream, apart from the socket: a body-less request
//! written out, an answer's head parsed with httparse into the parts of an
//! `http::Response` and the framing of its body (RFC 9112 §6.3, decided as hyper's client
//! decides it), and a chunked body decoded. Limits are hyper's client's defaults, so an
//! answer hyper's client takes is taken here and one it refuses is refused.

use std::mem::MaybeUninit;

use bytes::{Bytes, BytesMut};
use http::header::{CONNECTION, CONTENT_LENGTH, HOST, TRANSFER_ENCODING};
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Version};

/// Most header lines in an answer's head, and in a chunked body's trailers.
pub const MAX_HEADERS: usize = 100;
/// Most bytes of an answer's head.
pub const MAX_HEAD_BYTES: usize = 8192 + 4096 * 100;
/// Most bytes of chunk extensions in one body (they are read and dropped).
const MAX_EXTENSION_BYTES: u64 = 16 * 1024;
/// Most bytes of a chunked body's trailer section.
const MAX_TRAILER_BYTES: usize = 16 * 1024;

/// Why an answer cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// httparse rejected the head.
    #[error("the upstream's answer head is malformed")]
    Head(#[source] httparse::Error),
    /// The head did not end within [`MAX_HEAD_BYTES`].
    #[error("the upstream's answer head exceeds {MAX_HEAD_BYTES} bytes")]
    HeadTooLarge,
    /// A status code outside 100–999, or a header httparse passed and `http` did not.
    #[error("the upstream's answer head has an invalid {0}")]
    Invalid(&'static str),
    /// Content-Length values that do not parse or disagree.
    #[error("the upstream's answer has an invalid Content-Length")]
    ContentLength,
    /// Transfer-Encoding on an HTTP/1.0 answer, which cannot have one.
    #[error("the upstream's HTTP/1.0 answer has a Transfer-Encoding")]
    TransferEncodingOn10,
    /// A chunked body that breaks the grammar or a limit.
    #[error("the upstream's chunked body is malformed: {0}")]
    Chunked(&'static str),
}

/// Writes a request with no body: its line, `headers` as they are (and `host` last
/// when they have no Host, where hyper's client adds it), and the blank line. No
/// framing header: a request without Content-Length or Transfer-Encoding has no body.
pub fn write_request(
    out: &mut Vec<u8>,
    method: &Method,
    target: &str,
    headers: &HeaderMap,
    host: &str,
) {
    out.extend_from_slice(method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(if target.is_empty() { "/" } else { target }.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    for (name, value) in headers {
        line(out, name.as_str().as_bytes(), value.as_bytes());
    }
    if !headers.contains_key(HOST) {
        line(out, b"host", host.as_bytes());
    }
    out.extend_from_slice(b"\r\n");
}

fn line(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// How an answer's body ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// After this many bytes (0 for 204, 304 and an empty answer).
    Length(u64),
    /// After the last chunk and its trailers.
    Chunked,
    /// When the upstream closes the connection.
    Close,
}

/// An answer's head.
#[derive(Debug)]
pub struct Head {
    pub status: StatusCode,
    pub version: Version,
    pub headers: HeaderMap,
    /// The reason phrase, when it is not the status's canonical one.
    pub reason: Option<Bytes>,
    pub framing: Framing,
    /// Whether the connection may carry another request once the body has been read.
    pub keep_alive: bool,
}

/// Parses the answer head at the start of `buf` and removes it (with any informational
/// 1xx heads before it) from `buf`; `Ok(None)` while the head is incomplete.
pub fn parse_head(buf: &mut BytesMut) -> Result<Option<Head>, WireError> {
    loop {
        let mut slots = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
        let mut spans = [(0usize, 0usize, 0usize, 0usize); MAX_HEADERS];
        let mut parsed = httparse::Response::new(&mut []);
        let start = buf.as_ptr() as usize;
        let (len, code, reason, minor, count) = match httparse::ParserConfig::default()
            .parse_response_with_uninit_headers(&mut parsed, buf, &mut slots)
        {
            Ok(httparse::Status::Complete(len)) => {
                let code = parsed.code.unwrap_or(0);
                let reason = parsed.reason.unwrap_or("");
                let canonical = StatusCode::from_u16(code)
                    .ok()
                    .and_then(|s| s.canonical_reason());
                let reason =
                    (canonical != Some(reason)).then(|| Bytes::copy_from_slice(reason.as_bytes()));
                for (span, h) in spans.iter_mut().zip(parsed.headers.iter()) {
                    let name = h.name.as_ptr() as usize - start;
                    let value = h.value.as_ptr() as usize - start;
                    *span = (name, name + h.name.len(), value, value + h.value.len());
                }
                (
                    len,
                    code,
                    reason,
                    parsed.version.unwrap_or(1),
                    parsed.headers.len(),
                )
            }
            Ok(httparse::Status::Partial) if buf.len() >= MAX_HEAD_BYTES => {
                return Err(WireError::HeadTooLarge);
            }
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(e) => return Err(WireError::Head(e)),
        };
        let status = StatusCode::from_u16(code).map_err(|_| WireError::Invalid("status"))?;
        let head = buf.split_to(len).freeze();
        let switched = status == StatusCode::SWITCHING_PROTOCOLS;
        if status.is_informational() && !switched {
            continue;
        }
        let version = if minor == 1 {
            Version::HTTP_11
        } else {
            Version::HTTP_10
        };
        let mut keep_alive = version == Version::HTTP_11;
        let mut saw_close = false;
        let mut headers = HeaderMap::with_capacity(count);
        for &(n0, n1, v0, v1) in &spans[..count] {
            let name = HeaderName::from_bytes(&head[n0..n1])
                .map_err(|_| WireError::Invalid("header name"))?;
            let value = HeaderValue::from_maybe_shared(head.slice(v0..v1))
                .map_err(|_| WireError::Invalid("header value"))?;
            if name == CONNECTION {
                if saw_close || has_token(&value, "close") {
                    saw_close = true;
                    keep_alive = false;
                } else if !keep_alive {
                    keep_alive = has_token(&value, "keep-alive");
                }
            }
            headers.append(name, value);
        }
        // A 101 is passed on as hyper's client passes it: a head with no body, after
        // which the connection speaks something else and is not reused.
        let framing = if switched {
            keep_alive = false;
            Framing::Length(0)
        } else {
            framing(status, version, &headers)?
        };
        if headers.contains_key(TRANSFER_ENCODING) {
            // Transfer-Encoding overrides a Content-Length, which must not be passed on
            // beside a body it does not describe (RFC 9112 §6.3).
            headers.remove(CONTENT_LENGTH);
        }
        return Ok(Some(Head {
            status,
            version,
            headers,
            reason,
            framing,
            keep_alive,
        }));
    }
}

fn framing(
    status: StatusCode,
    version: Version,
    headers: &HeaderMap,
) -> Result<Framing, WireError> {
    if status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
        return Ok(Framing::Length(0));
    }
    if headers.contains_key(TRANSFER_ENCODING) {
        if version == Version::HTTP_10 {
            return Err(WireError::TransferEncodingOn10);
        }
        // Chunked only when it is the last coding; any other ends at the close.
        let last = headers.get_all(TRANSFER_ENCODING).iter().next_back();
        let chunked = last
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.rsplit(',').next())
            .is_some_and(|c| c.trim().eq_ignore_ascii_case("chunked"));
        return Ok(if chunked {
            Framing::Chunked
        } else {
            Framing::Close
        });
    }
    if !headers.contains_key(CONTENT_LENGTH) {
        return Ok(Framing::Close);
    }
    let mut length = None;
    for value in headers.get_all(CONTENT_LENGTH) {
        let text = value.to_str().map_err(|_| WireError::ContentLength)?;
        for part in text.split(',') {
            let n = digits(part.trim()).ok_or(WireError::ContentLength)?;
            if length.is_some_and(|l| l != n) {
                return Err(WireError::ContentLength);
            }
            length = Some(n);
        }
    }
    // The largest length hyper's client takes (its length type keeps u64::MAX for
    // "chunked" and the one below it for "until close").
    match length {
        Some(n) if n < u64::MAX - 1 => Ok(Framing::Length(n)),
        _ => Err(WireError::ContentLength),
    }
}

/// A Content-Length value: decimal digits only, no sign, no overflow.
fn digits(text: &str) -> Option<u64> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.bytes().try_fold(0u64, |n, b| {
        n.checked_mul(10)?.checked_add(u64::from(b - b'0'))
    })
}

fn has_token(value: &HeaderValue, token: &str) -> bool {
    value
        .to_str()
        .is_ok_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
}

/// What [`Chunked::decode`] found in the buffer.
#[derive(Debug)]
pub enum Decoded {
    /// Body bytes.
    Data(Bytes),
    /// The trailer fields after the last chunk; the body has ended.
    Trailers(HeaderMap),
    /// The body has ended.
    End,
    /// The buffer holds no more of the body: read more.
    More,
}

/// Where a chunked body's decoding stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Size,
    SizeSpace,
    Extension,
    SizeLf,
    Data,
    DataCr,
    DataLf,
    EndCr,
    EndLf,
    Trailer,
    TrailerLf,
    End,
}

/// A chunked body's decoder, fed from the connection's read buffer.
#[derive(Debug)]
pub struct Chunked {
    state: State,
    size: u64,
    extension_bytes: u64,
    trailers: Option<BytesMut>,
    trailer_lines: usize,
}

impl Default for Chunked {
    fn default() -> Self {
        Chunked {
            state: State::Size,
            size: 0,
            extension_bytes: 0,
            trailers: None,
            trailer_lines: 0,
        }
    }
}

impl Chunked {
    /// Decodes from the front of `buf`, removing what it used.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Decoded, WireError> {
        loop {
            if self.state == State::End {
                return match self.trailers.take() {
                    Some(section) => trailers(&section, self.trailer_lines).map(Decoded::Trailers),
                    None => Ok(Decoded::End),
                };
            }
            if self.state == State::Data {
                if buf.is_empty() {
                    return Ok(Decoded::More);
                }
                let n = usize::try_from(self.size)
                    .unwrap_or(usize::MAX)
                    .min(buf.len());
                self.size -= n as u64;
                if self.size == 0 {
                    self.state = State::DataCr;
                }
                return Ok(Decoded::Data(buf.split_to(n).freeze()));
            }
            let Some(&byte) = buf.first() else {
                return Ok(Decoded::More);
            };
            let _ = buf.split_to(1);
            self.state = self.step(byte)?;
        }
    }

    /// One byte outside a chunk's data.
    fn step(&mut self, byte: u8) -> Result<State, WireError> {
        let bad = |why| Err(WireError::Chunked(why));
        match (self.state, byte) {
            (State::Size, b'0'..=b'9' | b'a'..=b'f' | b'A'..=b'F') => {
                let digit = (byte as char).to_digit(16).map_or(0, u64::from);
                self.size = self
                    .size
                    .checked_mul(16)
                    .and_then(|s| s.checked_add(digit))
                    .ok_or(WireError::Chunked("chunk size overflows"))?;
                Ok(State::Size)
            }
            (State::Size | State::SizeSpace, b' ' | b'\t') => Ok(State::SizeSpace),
            (State::Size | State::SizeSpace, b';') => Ok(State::Extension),
            (State::Size | State::SizeSpace | State::Extension, b'\r') => Ok(State::SizeLf),
            (State::Size, _) => bad("invalid chunk size"),
            (State::SizeSpace, _) => bad("invalid space after the chunk size"),
            (State::Extension, b'\n') => bad("a chunk extension holds a bare LF"),
            (State::Extension, _) => {
                self.extension_bytes += 1;
                if self.extension_bytes >= MAX_EXTENSION_BYTES {
                    return bad("chunk extensions over the limit");
                }
                Ok(State::Extension)
            }
            (State::SizeLf, b'\n') if self.size == 0 => Ok(State::EndCr),
            (State::SizeLf, b'\n') => Ok(State::Data),
            (State::SizeLf, _) => bad("no LF after the chunk size"),
            (State::DataCr, b'\r') => Ok(State::DataLf),
            (State::DataCr, _) => bad("no CR after the chunk data"),
            (State::DataLf, b'\n') => Ok(State::Size),
            (State::DataLf, _) => bad("no LF after the chunk data"),
            (State::EndCr, b'\r') => {
                self.keep(byte)?;
                Ok(State::EndLf)
            }
            (State::EndCr, _) => {
                self.trailers.get_or_insert_with(BytesMut::new);
                self.keep(byte)?;
                Ok(State::Trailer)
            }
            (State::Trailer, _) => {
                self.keep(byte)?;
                Ok(if byte == b'\r' {
                    State::TrailerLf
                } else {
                    State::Trailer
                })
            }
            (State::TrailerLf, b'\n') => {
                if self.trailer_lines >= MAX_HEADERS {
                    return bad("too many trailer fields");
                }
                self.trailer_lines += 1;
                self.keep(byte)?;
                Ok(State::EndCr)
            }
            (State::TrailerLf, _) => bad("no LF after a trailer field"),
            (State::EndLf, b'\n') => {
                self.keep(byte)?;
                Ok(State::End)
            }
            (State::EndLf, _) => bad("no LF after the last chunk"),
            (State::Data | State::End, _) => unreachable!("handled by decode"),
        }
    }

    /// Keeps a byte of the trailer section, once one has started.
    fn keep(&mut self, byte: u8) -> Result<(), WireError> {
        if let Some(section) = &mut self.trailers {
            if section.len() >= MAX_TRAILER_BYTES {
                return Err(WireError::Chunked("trailers over the limit"));
            }
            section.extend_from_slice(&[byte]);
        }
        Ok(())
    }
}

fn trailers(section: &[u8], lines: usize) -> Result<HeaderMap, WireError> {
    let mut slots = vec![httparse::EMPTY_HEADER; lines];
    let bad = WireError::Chunked("malformed trailers");
    let parsed = match httparse::parse_headers(section, &mut slots) {
        Ok(httparse::Status::Complete((_, parsed))) => parsed,
        _ => return Err(bad),
    };
    let mut map = HeaderMap::with_capacity(parsed.len());
    for h in parsed.iter() {
        let name = HeaderName::from_bytes(h.name.as_bytes())
            .map_err(|_| WireError::Chunked("malformed trailers"))?;
        let value = HeaderValue::from_bytes(h.value)
            .map_err(|_| WireError::Chunked("malformed trailers"))?;
        map.append(name, value);
    }
    Ok(map)
}
