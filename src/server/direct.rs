//! HTTP/1.1 requests read and answered without hyper's server. An HTTP/1.1 connection
//! starts here: each request head is read with httparse (the parser hyper itself uses,
//! with hyper's settings), and a plain `GET` (HTTP/1.1, no body, no connection header)
//! is answered here: at once when the handler can ([`Handler::answer_now`]: a refusal, a
//! cache hit), else through [`Handler::call_head`] (a miss, a pass-through), with no
//! dispatcher and no body of hyper's per request. Everything else goes to hyper, with
//! the bytes already read put back in front ([`Handoff`]): a request with a body or a
//! connection header, `HEAD` and other methods, HTTP/1.0, anything httparse or `http`
//! refuses, a head over the size limit or with a long target (hyper and the server
//! answer 431, 400, 414 as always). From the first request handed over, the connection
//! stays with hyper.
//!
//! An answer is written as hyper writes it (status line, the handler's headers, then
//! `content-length` and `date` unless it states its own) when it is plain: HTTP/1.1, a
//! status that carries a body, no framing or connection header, a body of known
//! length. Any other answer is handed to hyper with its request and written there.
//! Writing an answer is `answer`'s; this file reads heads and runs the loop.

use std::io;
use std::net::SocketAddr;
use std::pin::pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use http::header::{self, HeaderName};
use http::{HeaderMap, HeaderValue, Request, Response, Uri};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::time::Instant;

use super::signal::Signal;
use super::{ConnectionInfo, Handler};
use answer::{Encoded, encode, fill, write_out};
use bloomgate_core::report::Chain;

/// What a connection hands to hyper once this loop stops answering.
pub(super) struct Handoff<B> {
    /// Bytes read and not answered, the head of the request to answer next first.
    pub(super) read: BytesMut,
    /// The answer already made to that request, when it was not plain enough to be
    /// written here: hyper writes it as the answer to the request it reads first.
    pub(super) answered: Option<Response<B>>,
}

/// The limits of the listener that apply to a request head.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    /// Largest head read (`ServeOptions::max_header_bytes`, as hyper is given it).
    pub(super) head: usize,
    /// Longest target answered here (`ServeOptions::max_uri_bytes`).
    pub(super) target: usize,
    /// Time a head has to arrive, counted from the connection's start or its last answer.
    pub(super) header_read: Duration,
}

/// Most header lines of a head answered here; a head with more goes to hyper (which
/// takes up to 100).
const MAX_HEADERS: usize = 32;

/// Room the read buffer starts with, as hyper's.
const READ_BUFFER: usize = 8192;

/// Headers that change how a request is framed or how its connection behaves: a head
/// with one of them goes to hyper.
const HYPER_HEADERS: [HeaderName; 6] = [
    header::CONTENT_LENGTH,
    header::TRANSFER_ENCODING,
    header::CONNECTION,
    header::UPGRADE,
    header::EXPECT,
    header::TE,
];

/// Answers requests on `io` until one must go to hyper (returned with what was read),
/// or the connection ends here (`None`): the client closed it, sent no whole head in
/// time, or `closing` fired while no request was in progress.
pub(super) async fn serve<H, T>(
    handler: &H,
    io: &mut T,
    peer: SocketAddr,
    info: ConnectionInfo,
    limits: Limits,
    closing: &mut Signal<'_>,
    listener: &'static str,
) -> Option<Handoff<H::Body>>
where
    H: Handler,
    T: AsyncRead + AsyncWrite + Unpin,
{
    let mut read = BytesMut::with_capacity(READ_BUFFER);
    let mut out: Vec<u8> = Vec::new();
    // Bytes of `read` already known to hold no whole head.
    let mut scanned = 0;
    let mut head = Head::default();
    // The request's header map, kept from one request to the next with its room.
    let mut headers = HeaderMap::new();
    let mut deadline = Instant::now() + limits.header_read;
    let mut timer = pin!(tokio::time::sleep_until(deadline));
    loop {
        let mut answered = false;
        while !read.is_empty() {
            if scanned > 0 && !may_be_complete(&read, scanned) {
                break;
            }
            match parse(&read, limits, &mut head) {
                Parsed::Partial => {
                    scanned = read.len();
                    break;
                }
                Parsed::Hyper => return hand_over(io, &mut out, read, None, listener, peer).await,
                Parsed::Get => {}
            }
            scanned = 0;
            let head_bytes = read.split_to(head.len).freeze();
            let Some(req) = head.request(&head_bytes, std::mem::take(&mut headers)) else {
                put_back(&mut read, &head_bytes);
                return hand_over(io, &mut out, read, None, listener, peer).await;
            };
            let resp = match handler.answer_now(&req, peer) {
                Some(resp) => {
                    headers = req.into_parts().0.headers;
                    headers.clear();
                    resp
                }
                None => {
                    let mut req = req;
                    req.extensions_mut().insert(info);
                    let Some(waiting) = handler.call_head(req, peer) else {
                        put_back(&mut read, &head_bytes);
                        return hand_over(io, &mut out, read, None, listener, peer).await;
                    };
                    // What is answered already goes out before the wait.
                    if !out.is_empty()
                        && let Err(e) = write_out(io, &mut out).await
                    {
                        tracing::debug!(listener, %peer, error = %Chain(&e), "answer not written");
                        return None;
                    }
                    // Boxed: the handler's future for a request that waits is thousands
                    // of bytes, and inlined it would grow every connection's task.
                    Box::pin(waiting).await
                }
            };
            match encode(resp, &mut out) {
                Encoded::Whole => {}
                Encoded::Streaming(rest) => {
                    if let Err(e) = fill(io, &mut out, rest).await {
                        tracing::debug!(listener, %peer, error = %Chain(&e), "answer not written");
                        return None;
                    }
                }
                Encoded::NotPlain(resp) => {
                    put_back(&mut read, &head_bytes);
                    return hand_over(io, &mut out, read, Some(resp), listener, peer).await;
                }
                Encoded::Failed => {
                    tracing::debug!(listener, %peer, "answer body failed; closing");
                    let _ = write_out(io, &mut out).await;
                    return None;
                }
            }
            answered = true;
        }
        if !out.is_empty()
            && let Err(e) = write_out(io, &mut out).await
        {
            tracing::debug!(listener, %peer, error = %Chain(&e), "answer not written");
            return None;
        }
        if answered {
            deadline = Instant::now() + limits.header_read;
        }
        if read.len() >= limits.head {
            // No whole head within the limit: hyper answers 431.
            return hand_over(io, &mut out, read, None, listener, peer).await;
        }
        if read.capacity() - read.len() < 1024 {
            read.reserve(READ_BUFFER);
        }
        let room = limits.head - read.len();
        let event = {
            let mut limited = (&mut read).limit(room);
            let mut reading = pin!(io.read_buf(&mut limited));
            std::future::poll_fn(|cx: &mut Context<'_>| {
                if closing.poll_fired(cx) {
                    return Poll::Ready(Event::Closing);
                }
                if let Poll::Ready(n) = reading.as_mut().poll(cx) {
                    return Poll::Ready(Event::Read(n));
                }
                timer.as_mut().poll(cx).map(|()| Event::Timer)
            })
            .await
        };
        match event {
            Event::Read(Ok(0)) => {
                if !read.is_empty() {
                    tracing::debug!(listener, %peer, "connection closed in a request head");
                }
                return None;
            }
            Event::Read(Ok(_)) => {}
            Event::Read(Err(e)) => {
                tracing::debug!(listener, %peer, error = %Chain(&e), "connection ended with an error");
                return None;
            }
            Event::Closing => {
                end(io).await;
                return None;
            }
            Event::Timer if Instant::now() < deadline => timer.as_mut().reset(deadline),
            Event::Timer => {
                tracing::debug!(listener, %peer, "no request within the header read timeout");
                end(io).await;
                return None;
            }
        }
    }
}

/// What woke the loop while it waited for bytes.
enum Event {
    Read(io::Result<usize>),
    Closing,
    /// The timer armed for an older deadline, or for this one.
    Timer,
}

/// Writes what was answered, then hands the connection over.
async fn hand_over<B, T: AsyncWrite + Unpin>(
    io: &mut T,
    out: &mut Vec<u8>,
    read: BytesMut,
    answered: Option<Response<B>>,
    listener: &'static str,
    peer: SocketAddr,
) -> Option<Handoff<B>> {
    if !out.is_empty()
        && let Err(e) = write_out(io, out).await
    {
        tracing::debug!(listener, %peer, error = %Chain(&e), "answer not written");
        return None;
    }
    // An empty buffer's room is let go: hyper reads into its own.
    let read = if read.is_empty() {
        BytesMut::new()
    } else {
        read
    };
    Some(Handoff { read, answered })
}

/// Puts a head taken from `read` back in front of what follows it.
fn put_back(read: &mut BytesMut, head: &Bytes) {
    let mut whole = BytesMut::with_capacity(head.len() + read.len());
    whole.extend_from_slice(head);
    whole.extend_from_slice(read);
    *read = whole;
}

/// Closes the write side (a TLS stream sends its close_notify), as hyper does when it
/// ends a connection; a client that does not read gets no longer than a moment.
async fn end<T: AsyncWrite + Unpin>(io: &mut T) {
    let _ = tokio::time::timeout(Duration::from_secs(1), io.shutdown()).await;
}

/// Whether `read` may hold a whole head now that bytes past `scanned` arrived: a blank
/// line can only end in them (or straddle their start). Spares a client that sends its
/// head a byte at a time a parse of the whole head for each byte.
fn may_be_complete(read: &[u8], scanned: usize) -> bool {
    let from = scanned.saturating_sub(3);
    let tail = &read[from..];
    tail.windows(2).any(|w| w == b"\n\n") || tail.windows(3).any(|w| w == b"\n\r\n")
}

/// A head as httparse read it, in offsets into the bytes it was read from (ranges,
/// as start and end). One per connection, filled in by each [`parse`].
struct Head {
    /// Length of the head, blank line included.
    len: usize,
    target: (u32, u32),
    /// Name and value of each header line, in the order sent.
    headers: [[u32; 4]; MAX_HEADERS],
    count: usize,
}

impl Default for Head {
    fn default() -> Head {
        Head {
            len: 0,
            target: (0, 0),
            headers: [[0; 4]; MAX_HEADERS],
            count: 0,
        }
    }
}

enum Parsed {
    /// No whole head yet.
    Partial,
    /// A plain `GET` this loop may answer, now in the [`Head`].
    Get,
    /// Anything else: hyper reads it (and refuses it, if it must).
    Hyper,
}

/// Reads the head at the start of `read` into `head`.
fn parse(read: &[u8], limits: Limits, head: &mut Head) -> Parsed {
    let mut headers = [const { std::mem::MaybeUninit::uninit() }; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut []);
    let parsed = httparse::ParserConfig::default().parse_request_with_uninit_headers(
        &mut req,
        read,
        &mut headers,
    );
    let len = match parsed {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Parsed::Partial,
        Err(_) => return Parsed::Hyper,
    };
    let (Some("GET"), Some(1), Some(target)) = (req.method, req.version, req.path) else {
        return Parsed::Hyper;
    };
    // Offsets fit: the head is no longer than the limit, which is a `usize` of config
    // no larger than a u32 (anything else goes to hyper).
    let Ok(limit) = u32::try_from(limits.head) else {
        return Parsed::Hyper;
    };
    if len > limit as usize || target.len() > limits.target || !target.starts_with('/') {
        return Parsed::Hyper;
    }
    let at = |s: &[u8]| {
        let start = s.as_ptr() as usize - read.as_ptr() as usize;
        (start as u32, (start + s.len()) as u32)
    };
    head.len = len;
    head.target = at(target.as_bytes());
    head.count = req.headers.len();
    for (slot, h) in head.headers.iter_mut().zip(req.headers.iter()) {
        if HYPER_HEADERS
            .iter()
            .any(|n| n.as_str().eq_ignore_ascii_case(h.name))
        {
            return Parsed::Hyper;
        }
        let (name, value) = (at(h.name.as_bytes()), at(h.value));
        *slot = [name.0, name.1, value.0, value.1];
    }
    Parsed::Get
}

impl Head {
    /// The request as hyper would hand it to a service, its target and values sharing
    /// `bytes` (the head), its headers in `headers` (empty); `None` when `http`
    /// refuses a part of it.
    fn request(&self, bytes: &Bytes, mut headers: HeaderMap) -> Option<Request<()>> {
        let range = |from: u32, to: u32| from as usize..to as usize;
        let uri = Uri::from_maybe_shared(bytes.slice(range(self.target.0, self.target.1))).ok()?;
        headers.reserve(self.count);
        for &[n0, n1, v0, v1] in &self.headers[..self.count] {
            let name = HeaderName::from_bytes(&bytes[range(n0, n1)]).ok()?;
            let value = HeaderValue::from_maybe_shared(bytes.slice(range(v0, v1))).ok()?;
            headers.append(name, value);
        }
        let mut req = Request::new(());
        *req.uri_mut() = uri;
        *req.headers_mut() = headers;
        Some(req)
    }
}

mod answer;
#[cfg(test)]
mod tests;
